"""The serving benchmark starts the plugin with the README's serve line, nothing else."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from bench.serve_bench import GPU_WORKER, SCHEDULER, plugin_flags

README = Path(__file__).parents[2] / "README.md"


def readme_serve_line() -> list[str]:
    text = README.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    block = next((b for b in blocks if "vllm serve " in b), None)
    assert block is not None, "README has no vllm serve block"
    line = block.split("vllm serve", 1)[1].replace("\\\n", " ")
    return shlex.split(line.replace('"$(python -m dynoff.compile_pass.config)"', "CC"))


def test_the_readme_line_is_the_benchmarks_line() -> None:
    words = readme_serve_line()
    assert "VLLM_USE_V2_MODEL_RUNNER" not in README.read_text().split("## Configuration")[0]
    assert words[0] == "Qwen/Qwen3-32B"
    assert words[1:] == ["--worker-cls", GPU_WORKER, "--scheduler-cls", SCHEDULER, "-cc", "CC"]
    flags = plugin_flags({})
    assert flags[:5] == [*words[1:6]]
    printed = subprocess.run(
        [sys.executable, "-m", "dynoff.compile_pass.config"], capture_output=True, text=True
    )
    assert json.loads(printed.stdout) == json.loads(flags[5])  # what $(...) expands to
    assert flags[6:] == ["--additional-config", json.dumps({"dynamic_offload": {}})]
