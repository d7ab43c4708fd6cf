"""Quantizers for the 2-bit VQ format (AQLM 2x8) and the baselines of the quality study.

* :func:`quantize` -- dense weight -> (codes, codebooks, scales) in AQLM's 2x8 format
* :func:`finetune` -- tune codebooks and scales of several layers against a dense model's outputs
* :func:`rtn` -- round-to-nearest, asymmetric min-max per group (baseline)
* :func:`kmeans_vq` -- one plain k-means codebook over short vectors (baseline)
* :func:`relative_output_error` -- ``||X (W - W_hat)^T|| / ||X W^T||`` from ``X^T X``
"""

from tilefuse.quantizer.baselines import kmeans_vq, relative_output_error, rtn
from tilefuse.quantizer.finetune import finetune
from tilefuse.quantizer.quantize import quantize

__all__ = ["quantize", "finetune", "rtn", "kmeans_vq", "relative_output_error"]
