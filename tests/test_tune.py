"""``tilefuse tune``: shapes from a model or a config, the CPU pipeline check, and the table it
writes being what the dispatch then reads."""

import json

import pytest

from tilefuse import _dispatch, cli, tune
from tilefuse.ops.swiglu import configs


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private XDG cache folder, and the dispatch's caches cleared around the test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _dispatch.reload_tuned()
    configs.decide.cache_clear()
    yield tmp_path / "tilefuse"
    monkeypatch.undo()
    _dispatch.reload_tuned()
    configs.decide.cache_clear()


def test_shapes_from_a_hf_config():
    config = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
              "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_routed_experts": 256}
    assert tune.shapes_from_config(config) == [(7168, 18432), (7168, 2048), (7168, 2048)]
    assert (7168, 256) in tune.shapes_from_config(config, (1, 8))
    with pytest.raises(ValueError, match="hidden_size"):
        tune.shapes_from_config({"intermediate_size": 8})


def test_cpu_pipeline_writes_a_table_the_dispatch_reads(cache, capsys):
    assert cli.main(["tune", "--shapes", "7168x2048", "--tokens", "1,128"]) == 0
    out, err = capsys.readouterr()
    assert "nothing timed" in err and "tuned-cpu.json" in out
    table = json.loads((cache / "tuned-cpu.json").read_text())
    entries = table["tuned"]["swiglu"]["7168,2048"]
    assert set(entries) == {"1", "128"} and all(e["measured"] is False for e in entries.values())
    choice = configs.decide(1, 7168, 2048, 132, None, "cpu")
    assert choice.source == "tuned table (tuned-cpu.json)" and choice.variant == entries["1"]["variant"]
    # an entry measured otherwise (here: edited) is what the dispatch runs, for every M it serves
    small = configs.SmallMConfig(16, 32, 256, 2, 3)
    entries["1"] = {"variant": "small_m", "config": small.__dict__, "measured": True}
    (cache / "tuned-cpu.json").write_text(json.dumps(table))
    _dispatch.reload_tuned()
    configs.decide.cache_clear()
    assert configs.choose(1, 7168, 2048, chip=None, tuned_name="cpu") == ("small_m", small)
    # no tuned table of this GPU: the shipped H200 one
    assert configs.choose(1, 7168, 2048) == ("small_m", configs.TUNED[(7168, 2048)][1]) != ("small_m", small)


def test_tune_refuses_bad_arguments(cache, capsys):
    assert cli.main(["tune"]) == 2
    assert cli.main(["tune", "--model-type", "no-such-model"]) == 2
    assert cli.main(["tune", "--shapes", "7168x2050"]) == 2
    assert cli.main(["tune", "--shapes", "7168", "--tokens", "1"]) == 2
    assert cli.main(["tune", "--shapes", "7168x2048", "--tp", "0"]) == 2
    err = capsys.readouterr().err
    assert "--model-type: expected one of" in err and "multiples of 8" in err and "--tp:" in err
    assert not cache.exists()
