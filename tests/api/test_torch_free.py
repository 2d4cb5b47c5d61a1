"""The API process imports no torch: what it sends the engine is `intone.protocol` (dataclasses and
numpy), and only the engine core's own process loads torch and the models."""

import subprocess
import sys

LOADED = "import sys, intone.api.server; print(*sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'intone')))"


def test_importing_the_api_server_leaves_torch_out():
    out = subprocess.run([sys.executable, "-c", LOADED], capture_output=True, text=True, timeout=120, check=True)
    loaded = out.stdout.split()
    assert "intone.api.server" in loaded and "intone.protocol" in loaded
    assert "torch" not in loaded, f"torch came in with: {[m for m in loaded if m.startswith('intone')]}"
