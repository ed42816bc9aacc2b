"""Generates the gRPC stubs from ../../proto when the package is built (see gen_stubs.py)."""

import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the build backend runs this file without its folder on the path
import gen_stubs  # noqa: E402


class BuildWithStubs(build_py):
    def run(self):
        gen_stubs.generate(self.build_lib)
        super().run()

    def find_package_modules(self, package, package_dir):
        # tinkerd.v1 exists only in build_lib, where gen_stubs wrote it.
        if package == "tinkerd.v1":
            return []
        return super().find_package_modules(package, package_dir)


os.chdir(HERE)
setup(cmdclass={"build_py": BuildWithStubs})
