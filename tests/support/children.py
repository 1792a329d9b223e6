"""Where the tests start child Pythons with `-c` or `-m`: Python puts the working directory first on such a child's
sys.path, and the checkout there would make the pack's folders (`kernels`, `nodes`, `models` ...) top-level modules
that shadow installed packages (transformers imports the PyPI `kernels`). An empty folder of this session instead."""

import atexit
import shutil
import tempfile

CHILD_CWD = tempfile.mkdtemp(prefix="omnivideo-child-cwd-")
atexit.register(shutil.rmtree, CHILD_CWD, ignore_errors=True)
