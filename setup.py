"""Builds blockspec's C++ CPU kernels (blockspec._kernels) against the installed torch.

Install with the project's Makefile, or by hand with torch==2.13.0 installed first and
`pip install --no-build-isolation -e .`: in an isolated build pip would resolve its own torch (a CUDA build
of several GB) to compile against."""

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[CppExtension(
        "blockspec._kernels",
        [f"blockspec/kernels/{name}.cpp" for name in (
            "gguf_blocks", "quant_matmul", "dense_matmul", "dense_leaf", "dense_tiles", "int8_pack",
            "int8_portable", "int8_ymm", "int8_zmm", "int8_matmul", "fused_ops", "attention_tiles", "attention",
            "attention_op", "layer_stack", "draft_context")],
        # OpenMP: at::parallel_for runs on torch's own thread pool (the libgomp torch ships), so torch's
        # thread count (--threads) governs the kernels too.
        extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"],
    )],
    cmdclass={"build_ext": BuildExtension},
)
