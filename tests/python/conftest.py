"""Makes the package importable from a source checkout when it is not installed (python/ on sys.path;
libepx.so is then found through $EPX_LIBRARY or a build*/ tree). Spawned test processes inherit sys.path."""

import os
import sys

try:
    import epx  # noqa: F401  (an installed package, or PYTHONPATH=python)
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "python"))
