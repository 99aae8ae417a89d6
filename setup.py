"""
salt-multimaster: safe and boring Salt multi-master high availability.

The loader modules live at the repository root (``_runners``, ``_modules``,
``_states``, ``_output``, ``_engines``) so that the repository also works as a ``file_roots``/gitfs root.
For ``pip install`` they are packaged inside ``salt_multimaster`` and found by
Salt through the ``salt.loader`` entry point.
"""

from setuptools import setup

setup(
    name="salt-multimaster",
    version="0.1.0",
    description="Replication, audit and minion configuration for Salt multi-master HA",
    long_description=open("README.rst", encoding="utf-8").read(),
    long_description_content_type="text/x-rst",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=[
        "salt_multimaster",
        "salt_multimaster.runners",
        "salt_multimaster.modules",
        "salt_multimaster.states",
        "salt_multimaster.output",
        "salt_multimaster.engines",
    ],
    package_dir={
        "salt_multimaster": "_utils/salt_multimaster",
        "salt_multimaster.runners": "_runners",
        "salt_multimaster.modules": "_modules",
        "salt_multimaster.states": "_states",
        "salt_multimaster.output": "_output",
        "salt_multimaster.engines": "_engines",
    },
    install_requires=["salt>=3006", "pyyaml"],
    extras_require={
        "tests": ["pytest>=7", "pytest-salt-factories>=1.0.0"],
    },
    entry_points={
        "salt.loader": ["salt-multimaster = salt_multimaster.loader:loader_dirs"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Framework :: Salt",
        "Topic :: System :: Clustering",
    ],
)
