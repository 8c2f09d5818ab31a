"""``probe TARGET page``: a live page for one process or a whole job, served by the CLI process.

The page asks the server here for JSON, and the server answers with the same client calls the commands
make (``diagnose``, ``ranks``, ``--all-ranks backtrace``'s grouping, ``--all-ranks query``, ``trace
export``): the page never knows more than the tools. The job's token stays in this process; the page
reads only (no eval), and it admits only its owner (``probe.page.access``: the peer's uid and the page
token). ``probe.page.data`` gathers and shapes, ``probe.page.server`` serves, and ``static/`` holds the
one HTML, JS and CSS file the browser loads (no network at run time).
"""

__all__ = ["access", "data", "server"]
