"""One owner-only file, replaced whole: written beside its place under a name of this process, then renamed
over it, so that a reader never sees half of it and a link planted at the temporary name is not followed.

Only ``os``: the outside reader's quick path imports this and nothing heavier."""

import os

__all__ = ["replace_private"]


def replace_private(path: str, body: bytes) -> bool:
    """Write ``body`` to ``path`` (mode 0600); False where it could not be (the caller carries on without it)."""
    temporary = "%s.%d.tmp" % (path, os.getpid())
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(body)
        os.replace(temporary, path)
        return True
    except OSError:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        return False
