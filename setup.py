"""Packaging for mp_bridge.

Install torch==2.13.0 (or the build your machine needs) *before* this package so pip never
resolves an unpinned torch (which pulls several GB of CUDA wheels on a CPU machine).
"""

from setuptools import find_packages, setup

setup(
    name="mp_bridge",
    version="0.1.0",
    description="Megatron-style model-parallel building blocks for colocated MIMO models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["mp_bridge", "mp_bridge.*"]),
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16,<0.20",
        "einops",
        "numpy",
        "safetensors",
    ],
    extras_require={
        # triton: the "triton" loss engine's tests run its kernels under TRITON_INTERPRET=1
        # (3.9.0 beside torch 2.13 here; the GPU runbook's machine has 3.6).
        # transformers: the HF tests' oracle (LlavaForConditionalGeneration built offline).
        "test": [
            "pytest",
            "hypothesis",
            "ruff",
            "triton>=3.6,<4; platform_system == 'Linux'",
            "transformers>=5,<6",
        ],
        "viz": ["matplotlib"],
        # mp_bridge.models.hf (config_from_hf, load_hf, save_hf, hf_batch)
        "hf": ["transformers>=5,<6", "safetensors"],
    },
    entry_points={"console_scripts": ["mp-bridge=mp_bridge.cli:main"]},
)
