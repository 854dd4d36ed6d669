"""Small JSON files beside a directory's checkpoints (the model registry, the pins), read and written whole.

read_json gives the object a sidecar holds, never through a symlink and
never more than a bound; write_json replaces it through a temporary file
renamed into place (0600, synced when durable).  Writers hold the
directory's exclusive lock, so two never lose each other's changes.
"""

import json
import os

from kvstore import _native, files, publish


def read_json(directory, name, max_bytes):
    """The JSON object in <directory>/<name>; None when there is none (or it cannot be read).

    Raises:
        ValueError: the file is there but larger than max_bytes or not a JSON object.
    """
    try:
        fd = os.open(os.path.join(directory, name), files.READ_FLAGS)
    except OSError:
        return None
    try:
        raw = os.read(fd, max_bytes + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        raise ValueError(f"{name} is larger than {max_bytes} bytes")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        obj = None
    if not isinstance(obj, dict):
        raise ValueError(f"{name} is not a JSON object")
    return obj


def write_json(directory, name, obj, durable=True):
    """Writes obj as <directory>/<name> (sorted keys, one level indented).

    Raises:
        OSError: it could not be written (the file there stays as it was).
    """
    body = json.dumps(obj, indent=1, sort_keys=True).encode()
    with publish.TempFile(os.path.join(directory, name)) as tmp:
        _native.pwrite_from(tmp.fd, body, 0, tmp.path)
        tmp.publish(durable)


__all__ = ["read_json", "write_json"]
