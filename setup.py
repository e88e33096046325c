import re

from setuptools import find_packages, setup

VERSION = re.search(r'__version__ = "(.+)"', open("cb_sync/__init__.py", encoding="utf-8").read()).group(1)

setup(
    name="cb_sync",
    version=VERSION,
    description="Synchronous continuous batching for Hugging Face causal LMs, from the very modules being trained",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    classifiers=[
        "Programming Language :: Python :: 3",
        "Operating System :: POSIX :: Linux",
        "Intended Audience :: Science/Research",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    packages=find_packages(include=["cb_sync", "cb_sync.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "transformers>=5.17,<6", "tqdm"],
    extras_require={
        "gpu": ["triton>=3.3"],
        "flash": ["flash-attn-4>=4.0.0b36", "nvidia-cutlass-dsl[cu13]>=4.8"],
        "trl": ["trl>=1.16,<1.17", "peft>=0.17", "accelerate"],
        "test": ["pytest", "hypothesis", "peft>=0.17", "triton>=3.3", "trl>=1.16,<1.17", "accelerate", "datasets",
                 "tokenizers"],
    },
    entry_points={"console_scripts": ["cb-sync=cb_sync.cli:main"]},
)
