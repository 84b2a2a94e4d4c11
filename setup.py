"""The package list, by discovery (everything else is in pyproject.toml): every package under
``mfsdp_core/`` and ``mfsdp_ckpt/``, ``cli/`` installed as ``mfsdp_cli`` (a top-level ``cli``
would clash with other projects'), and the native kernels' sources (``csrc/``) as the data of
``mfsdp_core._csrc``, which ``mfsdp_core.mx_native`` builds from on first use. A list written by
hand once missed two packages: the wheel installed, and its commands failed to import."""

from setuptools import find_packages, setup

LIBRARIES = ["mfsdp_core", "mfsdp_core.*", "mfsdp_ckpt", "mfsdp_ckpt.*"]
CLI = ["mfsdp_cli" + name[len("cli") :] for name in find_packages(include=["cli", "cli.*"])]

setup(
    packages=[*find_packages(include=LIBRARIES), *CLI, "mfsdp_core._csrc"],
    package_dir={"mfsdp_cli": "cli", "mfsdp_core._csrc": "csrc"},
    package_data={"mfsdp_core._csrc": ["*.cpp", "*.cu", "README.md"]},
)
