"""nn modules built on the ops; each family's module is imported on first use."""

from tilefuse._lazy import lazy_attribute

_PUBLIC = {
    "FusedSwiGLUMLP": "tilefuse.nn.swiglu",
    "VQLinear": "tilefuse.nn.vq",
    "VQSwiGLUMLP": "tilefuse.nn.vq",
    "VQMoEExperts": "tilefuse.nn.vq_moe",
    "MLADecodeAttention": "tilefuse.nn.mla",
}

__all__ = list(_PUBLIC)


def __getattr__(name):
    return lazy_attribute(__name__, _PUBLIC, name)
