import os
import sys

# The tests import the package from the build tree (PYTHONPATH=build/python);
# run by hand from the source tree, fall back to ../../build/python.
_build = os.path.join(os.path.dirname(__file__), "..", "..", "build", "python")
if "epx" not in sys.modules and not any(os.path.isfile(os.path.join(p, "epx", "__init__.py")) for p in sys.path if p):
    sys.path.insert(0, os.path.abspath(_build))
