"""The package list, the one setting pyproject.toml cannot express: every folder under twinkle_specs/,
plus the top-level folders that pyproject's package-dir maps into it (patches/ as twinkle_specs.patches,
launch/ as twinkle_specs.launch_scripts) with theirs. Everything else is in pyproject.toml."""

from setuptools import find_namespace_packages, setup


def packages(package: str, folder: str) -> list[str]:
    """``package`` (``folder``) and every subfolder, found; subfolders hold data as well as modules."""
    found = find_namespace_packages(where=folder, exclude=["*__pycache__*"])
    return [package, *(f"{package}.{name}" for name in found)]


setup(
    packages=[
        *packages("twinkle_specs", "twinkle_specs"),
        *packages("twinkle_specs.patches", "patches"),
        *packages("twinkle_specs.launch_scripts", "launch"),
    ]
)
