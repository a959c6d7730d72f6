"""What a configured command looks like once it runs (monitord.base.proc_identity): the
kernel's argv of a `#!` script, env's program, and commands compared by the executable they
resolve to — on real files, and checked against the argv a real process shows."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from monitord.base import proc_identity


def _script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


class TestExecForms:
    """The forms of a command are the argvs the kernel and `env` hand the process, in order."""

    def test_a_script_runs_as_interpreter_argument_script_and_args(self, tmp_path: Path) -> None:
        script = _script(tmp_path / "d", "#!/bin/sh -e  \necho\n")
        forms = proc_identity.exec_forms([str(script), "a"], search_path="", cwd="/")
        assert forms == [(str(script), "a"), ("/bin/sh", "-e", str(script), "a")]

    def test_a_name_found_on_path_runs_as_the_path_entry_joined(self, tmp_path: Path) -> None:
        _script(tmp_path / "bin" / "d", "#!/bin/sh\necho\n")
        forms = proc_identity.exec_forms(["d"], search_path=f"/nonexistent:{tmp_path}/bin",
                                         cwd="/")
        assert forms[-1] == ("/bin/sh", f"{tmp_path}/bin/d")

    def test_env_with_split_arguments_execs_the_program_it_finds(self, tmp_path: Path) -> None:
        script = _script(tmp_path / "d", "#!/usr/bin/env -S python3 -u\n")
        forms = proc_identity.exec_forms([str(script)], search_path="/usr/bin", cwd="/")
        assert forms[1:] == [("/usr/bin/env", "-S python3 -u", str(script)),
                             ("python3", "-u", str(script))]

    def test_an_interpreter_that_is_a_script_is_followed_too(self, tmp_path: Path) -> None:
        inner = _script(tmp_path / "interp", "#!/bin/sh\n")
        script = _script(tmp_path / "d", f"#!{inner} -x\n")
        forms = proc_identity.exec_forms([str(script)], search_path="", cwd="/")
        assert forms[-1] == ("/bin/sh", str(inner), "-x", str(script))

    def test_the_argv_a_real_script_process_shows_is_one_of_the_forms(
        self, tmp_path: Path
    ) -> None:
        _script(tmp_path / "bin" / "d", "#!/usr/bin/env python3\nimport time\ntime.sleep(30)\n")
        path = f"{Path(sys.executable).parent}{os.pathsep}{tmp_path}/bin"
        child = subprocess.Popen(["d", "--flag"], env={"PATH": path})
        try:
            deadline = time.monotonic() + 10
            while True:  # until env has exec'd python3 (the same pid; no argv mid-exec)
                identity = proc_identity.read(child.pid)
                assert identity is not None
                if identity.cmdline[:1] not in ((), ("/usr/bin/env",)):
                    break
                assert time.monotonic() < deadline, identity
                time.sleep(0.01)
            forms = proc_identity.exec_forms(["d", "--flag"], search_path=path, cwd="/")
            assert identity.cmdline == ("python3", f"{tmp_path}/bin/d", "--flag")
            assert identity.cmdline in forms
        finally:
            child.kill()
            child.wait()


class TestSameCommand:
    """Two commands are the same if their arguments are and argv[0] resolves to one file."""

    def test_a_name_on_path_and_its_full_path_are_the_same_command(self, tmp_path: Path) -> None:
        script = _script(tmp_path / "bin" / "d", "#!/bin/sh\n")
        assert proc_identity.same_command(["d", "x"], [str(script), "x"],
                                          a_path=str(tmp_path / "bin"), b_path="", cwd="/")

    def test_another_argument_or_another_file_is_another_command(self, tmp_path: Path) -> None:
        one = _script(tmp_path / "one", "#!/bin/sh\n")
        two = _script(tmp_path / "two", "#!/bin/sh\n")
        assert not proc_identity.same_command([str(one), "x"], [str(one), "y"],
                                              a_path="", b_path="", cwd="/")
        assert not proc_identity.same_command([str(one)], [str(two)], a_path="", b_path="",
                                              cwd="/")
