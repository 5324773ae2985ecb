"""A second gateway started by uvicorn itself (`uvicorn gateway.app:create_app --factory`) on a data dir
in use: one line, "cannot start: …", and exit 2, as `polyroute serve` does; it used to die with
uvicorn's traceback ending in DataDirLocked.

uvicorn runs for real in a subprocess; the data dir is held by a lock this test takes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from gateway.datadir_lock import DataDirLock

START_TIMEOUT_S = 180  # imports everything on a loaded 2-core machine
ADVICE = "stop that gateway, or give this one another data dir (POLYROUTE_DATA_DIR or --data-dir)"


def test_uvicorn_factory_on_a_held_data_dir_prints_one_line_and_exits_2(tmp_path):
    data_dir = tmp_path / "data"
    with socket.socket() as taken:
        # the port it is told to use is taken: had the refusal let it through, it could not serve
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with DataDirLock(data_dir, "127.0.0.1", 8555):
            env = {k: v for k, v in os.environ.items() if not k.startswith("POLYROUTE_")}
            env |= {"POLYROUTE_DATA_DIR": str(data_dir), "POLYROUTE_LOCAL_WORKERS": "0", "COLUMNS": "80"}
            command = [sys.executable, "-m", "uvicorn", "gateway.app:create_app", "--factory"]
            command += ["--host", "127.0.0.1", "--port", str(port)]
            result = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S, cwd=os.getcwd()
            )
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out, out
    [line] = out.strip().splitlines()
    assert line.startswith(
        f"cannot start: the data dir {data_dir.resolve()} is in use by another polyroute gateway "
        f"(pid {os.getpid()} on host {socket.gethostname()}, configured address 127.0.0.1:8555, started "
    ), line
    assert line.endswith(ADVICE), line
