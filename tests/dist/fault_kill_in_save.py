"""Run launch/train.py (in this process) and SIGKILL it in the middle of a checkpoint write.

    python tests/dist/fault_kill_in_save.py KILL_ON_SAVE KILL_AFTER_BYTES -- <train.py arguments>

The KILL_ON_SAVE-th call of ``gefen_dist.checkpoint.atomic_save`` (1-based) kills the process
with SIGKILL once KILL_AFTER_BYTES bytes of the temporary file have been written: what a crash,
an OOM kill or a preemption during a save leaves behind. Used by tests/test_faults.py.
"""
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from gefen_dist import checkpoint as gckpt  # noqa: E402
from launch import train  # noqa: E402


def main() -> None:
    kill_on, after = int(sys.argv[1]), int(sys.argv[2])
    argv = sys.argv[sys.argv.index("--") + 1:]
    calls = {"n": 0}
    real_save, real_write = gckpt.files.atomic_save, gckpt._HashingWriter.write  # what gckpt.save calls

    def save(obj, path, **kw):
        calls["n"] += 1
        return real_save(obj, path, **kw)

    def write(self, b):
        if calls["n"] == kill_on and self.n + len(memoryview(b).cast("B")) > after:
            real_write(self, memoryview(b).cast("B")[:max(0, after - self.n)])
            self.f.flush()
            sys.stderr.write(f"FAULT: SIGKILL during checkpoint save #{kill_on} after {after} bytes\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(self, b)

    gckpt.atomic_save = gckpt.files.atomic_save = save  # the public name, and the one save() calls
    gckpt._HashingWriter.write = write
    train.main(argv)


if __name__ == "__main__":
    main()
