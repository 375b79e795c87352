"""Maps the source folders onto the import package: plugin/ is hybrid_prefix_cache, patches/ its .patches."""

from setuptools import find_packages, setup

packages = ["hybrid_prefix_cache", "hybrid_prefix_cache.patches"]
packages += [f"hybrid_prefix_cache.{name}" for name in find_packages("plugin")]
setup(
    packages=packages,
    package_dir={"hybrid_prefix_cache": "plugin", "hybrid_prefix_cache.patches": "patches"},
)
