"""TensorFlow started quietly for the example scripts, so that they print only their own output.

Each example imports this module before Keras, TensorFlow or
``gradient_accumulator``. It sets ``TF_CPP_MIN_LOG_LEVEL=3`` unless the
variable is set already, then imports TensorFlow with the C++ log lines it
prints while loading filtered by that level. On a machine without a GPU both
are needed:

- TensorFlow reads ``TF_CPP_MIN_LOG_LEVEL`` when it loads, so it is set first.
  ``2`` drops INFO and WARNING lines; ``3`` also ERROR lines, such as
  ``E0000 ... failed call to cuInit`` when there is no CUDA driver.
- TensorFlow 2.19 and later print a few lines while loading, before they read
  the variable, whatever its value (tensorflow/tensorflow#100442): absl's
  ``WARNING: All log messages before absl::InitializeLog() ...`` and INFO
  lines on oneDNN and on missing CUDA drivers. The filter drops them by the
  same rule.

Python warnings and errors pass untouched. The kept lines are printed once
TensorFlow has loaded; ``TF_CPP_MIN_LOG_LEVEL=0`` shows everything TensorFlow
prints, unfiltered and as it prints it (what it says before a crash while
loading, too).
"""

import os
import re
import sys
import tempfile

# A C++ log line and its severity: absl's ("I0000 00:00:1700000000.000000
# 1234 port.cc:153] ...") or TensorFlow 2.16's ("2024-01-01 12:00:00.000000: I
# tensorflow/core/util/port.cc:113] ..."); absl's notice that it prints before
# it is initialised counts as a WARNING.
_LOG_LINE = re.compile(
    r"(?P<absl>[IWEF])\d{4} [\d:.]+ +\d+ [\w.-]+:\d+\] "
    r"|\d{4}-\d\d-\d\d [\d:.]+: (?P<tsl>[IWEF]) [\w./-]+:\d+\] "
    r"|(?P<notice>W)ARNING: All log messages before absl::InitializeLog\(\)"
)
_SEVERITIES = "IWEF"  # TF_CPP_MIN_LOG_LEVEL=n hides the first n


def _below(line, level):
    """Whether ``line`` is a C++ log line that ``TF_CPP_MIN_LOG_LEVEL=level`` hides."""
    match = _LOG_LINE.match(line)
    return match is not None and _SEVERITIES.index(match[match.lastgroup]) < level


def _import_tensorflow(level):
    """Imports TensorFlow; what it prints to stderr meanwhile, less the lines below ``level``."""
    sys.stderr.flush()
    saved_stderr = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow  # noqa: F401
        finally:
            sys.stderr.flush()
            os.dup2(saved_stderr, 2)
            os.close(saved_stderr)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not _below(line, level)))
            sys.stderr.flush()


os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
_level = os.environ["TF_CPP_MIN_LOG_LEVEL"]
if _level.isdigit() and int(_level) > 0:
    _import_tensorflow(int(_level))
