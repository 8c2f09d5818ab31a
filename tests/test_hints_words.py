"""A slip of a command's name is answered with the command meant, with or without a target before it."""

from procs import run_cli


def test_a_misspelt_command_names_the_command_meant():
    for argv, meant in ((["4242", "backtrac"], "'backtrace'"), (["node7:9700", "diagnsoe"], "'diagnose'"),
                        (["4242", "Query", "SELECT 1"], "'query'")):
        done = run_cli(*argv)
        assert done.code == 2, (argv, done.err)
        assert "No such command %r. Did you mean %s?" % (argv[1], meant) in done.err, done.err
    lone = run_cli("backtrac")
    assert lone.code == 2 and "Did you mean `probe TARGET backtrace`?" in lone.err, lone.err
    unlike = run_cli("4242", "frobnicate")
    assert unlike.code == 2 and "No such command 'frobnicate'." in unlike.err and "Did you mean" not in unlike.err


def test_a_refused_address_says_where_the_ranks_are_or_how_a_job_serves_there():
    """Lightning's ddp: rank 0 learns its rank after it started and serves on a free port, so PROBE_PORT refuses;
    the job's node helper still answers, and the error says to ask through it. Where nothing serves at all,
    the error says how a job comes to serve there."""
    import launch

    nothing = run_cli("127.0.0.1:%d" % launch.free_ports(1), "backtrace")
    assert nothing.code == 3 and "PROBE=1 PROBE_PORT=" in nothing.err and "probe list" in nothing.err, nothing.err
    why = launch.installed("python", "lightning.pytorch")
    if why:
        import pytest

        pytest.skip(why)
    with launch.lightning_job("ddp", 2) as job:
        at = "127.0.0.1:%d" % job.port
        refused = run_cli(at, "backtrace")
        assert refused.code == 3 and "connection refused" in refused.err, refused.err
        assert "`probe %s --ranks 0 COMMAND`" % at in refused.err and "Lightning" in refused.err, refused.err
        through = run_cli(at, "--ranks", "0", "backtrace")
        assert through.code == 0, through.err
