"""The example backend plugin of the docs (docs/tutorials/plugin_example) passes its own tests.

The tutorial "Writing a backend plugin" shows that package; running its test
file here keeps it working as parconv changes.
"""

import sys
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[1] / "docs" / "tutorials" / "plugin_example"
for path in (PLUGIN, PLUGIN / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from test_parconv_im2col import *  # noqa: E402,F401,F403 - pytest collects the imported tests
