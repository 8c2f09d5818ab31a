"""``probe diagnose`` names a NaN in the loss the framework logged (issue 32, item 6, the framework's last
logged loss): a Lightning classifier whose data hold a NaN logs ``train_loss`` nan at every step, in steps of
~3 s, longer than diagnose waits for a step's end to read the parameters (tests/targets/lightning_nan_loss.py).
Before, with the parameters not read, its steps advancing, it was called healthy; now the loss is read from
the Trainer's callback_metrics (torch.trainer's loss column) and the verdict is numerical (exit 10)."""

import json

from procs import run_cli, running, scaled
from test_diagnose import DEGRADED, _expect


def test_a_nan_loss_logged_by_lightning_is_named_where_the_parameters_are_not_read():
    with running("lightning_nan_loss.py", timeout=scaled(120)) as proc:
        target = str(proc.pid)
        table = run_cli(target, "query", "SELECT trainer, kind, loss, loss_from FROM torch.trainer", "--json",
                        timeout=scaled(60))
        assert table.code == 0, (table.out, table.err)
        rows = json.loads(table.out)
        assert [r["trainer"] for r in rows] == ["fitter"] and rows[0]["kind"] == "lightning", rows
        assert "fitter.callback_metrics['train_loss'] at global step " in rows[0]["loss_from"], rows
        result = _expect(target, DEGRADED, "numerical: the last logged loss is NaN on process %s" % target,
                         "fitter.callback_metrics['train_loss']")
        assert result.out.splitlines()[0].startswith("DEGRADED: numerical:"), result.out
        report = json.loads(run_cli(target, "diagnose", "--json", timeout=scaled(90)).out)
        verdict = next(v for v in report["verdicts"] if v["kind"] == "numerical")
        rows = verdict["evidence"][0]["rows"]
        assert rows and rows[0]["loss_from"].startswith("fitter.callback_metrics"), verdict


def test_a_nan_loss_in_a_hugging_face_trainers_log_history_is_named(tmp_path):
    """The same from HF Trainer's state.log_history (tests/targets/hf_trainer.py, a weight made NaN after step 1,
    the loss logged every step with its NaN filter off, 3 s steps: step 1's loss logged finite, every later one
    NaN; READY after step 2, the first NaN step, not two 3 s steps later)."""
    log = str(tmp_path / "log")
    with running("hf_trainer.py", log, "--max-steps", "100000", "--sleep", "3", "--nan-at", "1", "--ready-at", "2",
                 timeout=scaled(120)) as proc:
        target = str(proc.pid)
        _expect(target, DEGRADED, "numerical: the last logged loss is NaN on process %s" % target,
                "trainer.state.log_history[-1]['loss'] at step ")
