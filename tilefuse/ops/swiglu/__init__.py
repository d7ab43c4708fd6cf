from tilefuse.ops.swiglu.op import swiglu  # noqa: F401
