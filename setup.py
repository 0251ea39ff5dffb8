"""Install collective: collective communication for Ray actors."""

from setuptools import find_packages, setup

setup(
    name="collective",
    version="0.1.0",
    description="Fast, reliable collective communication for Ray actors over Gloo and NCCL",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["collective", "collective.*"]),
    package_data={"collective": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=["numpy>=1.24", "torch>=2.4", "ray>=2.9"],
    extras_require={
        "nccl": ["cupy-cuda12x"],
        "bench": ["matplotlib>=3.7"],
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "psutil>=5.9",
            "ruff>=0.6",
            "mypy>=1.11",
            "sphinx>=7.2",
            "myst-parser>=2.0",
            "matplotlib>=3.7",
            # the nccl_contract tests call cupy's real NCCL binding, without a GPU
            "cupy-cuda12x>=13",
            "nvidia-nccl-cu12>=2.21",
        ],
    },
)
