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
