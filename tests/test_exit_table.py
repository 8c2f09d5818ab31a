"""The table of exit codes (docs/reference.md) holds: each row run for real against one process without torch (and a pid with
none), the way a user meets it."""

from procs import run_cli, target_env


def test_each_row_of_the_exit_table(target_factory):
    proc = target_factory("idle.py")
    pid = str(proc.pid)
    rows = [
        (0, [pid, "health"]),
        (1, [pid, "query", "SELECT * FROM nowhere_at_all"]),  # SQL error
        (1, [pid, "eval", "1/0"]),  # exception in eval
        (2, [pid, "schema", "python.threds"]),  # a table that is not there
        (2, [pid, "trace", "start"]),  # torch not loaded in the target
        (2, [pid, "lr", "0.1"]),
        (2, [pid, "checkpoint", "/tmp/never-written.pt"]),
        (2, [pid, "query", "SELECT 1", "--max-rows", "-3"]),  # a bad option
        (3, ["99999999", "backtrace"]),  # no such process: every command alike
        (3, ["99999999", "inject"]),
        (3, ["127.0.0.1:1", "health"]),  # nothing listens
    ]
    wrong = []
    for code, argv in rows:
        done = run_cli(*argv)
        if done.code != code:
            wrong.append("probe %s: exit %d, not %d: %s" % (" ".join(argv), done.code, code, done.err.strip()[-300:]))
        elif code in (2, 3) and "--max-rows" not in argv and len(done.err.strip().splitlines()) != 1:
            wrong.append("probe %s: not one line: %r" % (" ".join(argv), done.err))
    assert not wrong, "\n".join(wrong)
    in_client = str(target_factory("idle.py", env=target_env(PROBE_SQL_IN_AGENT="")).pid)  # SQL runs in the client
    for where in (pid, in_client):
        for sql, table in (("SELECT * FROM python.threds", "'python.threds'"), ("SELECT * FROM threads", "'threads'")):
            typo = run_cli(where, "query", sql)
            assert typo.code == 1 and "no table named %s: did you mean python.threads?" % table in typo.err, typo.err
    schema = run_cli(pid, "schema", "python.threds")
    assert "did you mean python.threads?" in schema.err, schema.err
    torch = run_cli(pid, "trace", "start")
    assert "torch's tables, the trace, lr and checkpoint work once" in torch.err, torch.err
