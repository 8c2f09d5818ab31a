"""Who the ranks of a job are, and how a rank that gave no answer is told: the rows of ``probe ranks``,
``--ranks`` lists, and the errors a call across ranks ends with. Below the cluster, its discovery
(``probe.client.listing``) and its helpers' gathering (``probe.client.via_helpers``), which all use them."""

from typing import List, NamedTuple, Optional, Sequence

from probe.client.wording import option
from probe.errors import ProbeError, UsageError

__all__ = ["Member", "RankFailure", "NoRankAnswered", "MEMBER_COLUMNS", "MAX_RANKS", "parse_rank_list",
           "compact_ranks"]

MAX_RANKS = 1 << 20  # in a --ranks list: more is a typo, and would fill the client's memory
MEMBER_COLUMNS = ("rank", "host", "port", "pid", "state", "local_rank", "node", "world_size", "restarts",
                  "heartbeat_age")


class Member(NamedTuple):
    rank: int
    host: str  # the node's name (or the target as written, for an explicit list)
    address: str  # how the client reaches the agent: HOST:PORT
    port: Optional[int] = None
    pid: Optional[int] = None
    state: Optional[str] = None
    local_rank: Optional[int] = None
    node: Optional[int] = None
    world_size: Optional[int] = None
    restarts: Optional[int] = None
    heartbeat_age: Optional[float] = None
    helper: Optional[str] = None  # HOST:PORT of its node's host helper
    note: Optional[str] = None  # its port was taken (by whom), as its node's helper says

    @property
    def label(self) -> str:
        return "rank %d (%s)" % (self.rank, self.address)


class RankFailure(NamedTuple):
    """A rank that gave no answer: its rank, host, the error's code, what happened, and its exit code."""

    rank: int
    host: str
    code: str
    reason: str
    exit_code: int



class NoRankAnswered(ProbeError):
    """No rank answered a call: each one's reason is in ``failures`` (and in the message). The exit code is
    the first rank's, as the CLI's is when no rank answers."""

    code = "no_rank_answered"
    exit_code = 3

    def __init__(self, failures: Sequence[RankFailure], deadline: float) -> None:
        shown = ["rank %d (%s): %s" % (f.rank, f.host, f.reason) for f in failures[:3]]
        if len(failures) > 3:
            shown.append("and %d more" % (len(failures) - 3))
        timed_out = all(f.code == "timeout" for f in failures)
        super().__init__("none of the %d ranks answered: %s" % (len(failures), "; ".join(shown)),
                         hint=("none answered within the deadline of %.1f s: raise %s" % (deadline, option("--deadline",
                               "deadline=")) if timed_out else "`failures` names every rank and why"))
        self.failures = list(failures)
        if failures:
            self.exit_code = failures[0].exit_code


def _host_of(address: str) -> str:
    """The host of a checked ``HOST:PORT``, without the brackets of an IPv6 address."""
    return address.rpartition(":")[0].strip("[]")


def _with_port(host: str, port: int) -> str:
    return "%s:%d" % ("[%s]" % host if ":" in host else host, port)


def parse_rank_list(text: str) -> List[int]:
    """``"0-3,8"`` -> [0, 1, 2, 3, 8]."""
    out: List[int] = []
    for part in text.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        if low.isdigit() and (not dash or high.isdigit()):
            first, last = int(low), int(high if dash else low)
            if last < first:
                raise UsageError("the rank range %s is empty: it ends before it starts" % part,
                                 hint="write the lower rank first, e.g. --ranks %d-%d" % (last, first))
            if last - first > MAX_RANKS or len(out) > MAX_RANKS:
                raise UsageError("the rank list %r names more than %d ranks" % (text, MAX_RANKS),
                                 hint="e.g. --ranks 0-3,8, or --all-ranks")
            out.extend(range(first, last + 1))
            continue
        raise UsageError("cannot read the rank list %r" % text, hint="e.g. --ranks 0-3,8")
    return sorted(set(out))


def compact_ranks(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] -> ``"0-3,8"``."""
    values = sorted(set(ranks))
    parts = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else "%d-%d" % (values[i], values[j]))
        i = j + 1
    return ",".join(parts)
