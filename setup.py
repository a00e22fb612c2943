"""The one build step pyproject.toml cannot declare: the notebook panels' bundles (widgets/ -> ie_lab/static/).

Every build (``pip wheel .``, ``pip install .``, ``pip install -e .``) runs widgets/build.py's ``ensure``: it
rebuilds the bundles where esbuild is installed (``./dev setup``), and otherwise checks that the committed ones match
the sources, so installing needs no node. An unpacked wheel has no widgets/ folder and nothing to build.
"""

import runpy
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

WIDGET_BUILD = Path(__file__).resolve().parent / "widgets" / "build.py"


class BuildPyWithWidgets(build_py):
    def run(self) -> None:
        if WIDGET_BUILD.is_file():
            runpy.run_path(str(WIDGET_BUILD))["ensure"]()
        # setuptools reuses build/lib between builds: bundles (or sources) an earlier layout put there would ride along
        if not self.editable_mode:
            shutil.rmtree(Path(self.build_lib) / "ie_lab" / "static", ignore_errors=True)
        super().run()


setup(cmdclass={"build_py": BuildPyWithWidgets})
