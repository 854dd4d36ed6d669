"""ds4's checkpoint files as kvstore reads them (ds4 commit 8d57664, 2026-05-21).

kvstore follows ds4's disk KV cache; the two share a directory safely, and
this module holds everything about ds4's side of that:

- The envelope is the same (docs/format.md §2), but ds4 writes header bytes
  7 and 20..23 as 0: its payload ABI byte reads 0.  kvstore's own notes named
  2 for ds4's graph state; both are ds4's (DS4_ABIS): listed, counted in the
  budget, never loaded.
- ds4-server's tool map (ext bit 0) is not framed as kvstore's trailer
  sections are.  Right after the payload it writes

      "KTM"  u8 version (1)  u32 count
      count times:  u32 id length  u32 DSML length  id bytes  DSML bytes

  (little-endian; its loader takes ids of 1..256 bytes).  kvstore's trailer
  is a run of framed sections, each opening with its ext bit, 0..7; ds4's
  opens with "K" (75).  That first byte tells the two apart, so kvstore never
  reads a KTM body as sections nor sections as a KTM body, and ds4, finding
  no KTM magic in kvstore's trailer, loads nothing from it.
- Ext bits 1 and 2 (responses / thinking visible) say which rendering the
  text key is; they have no trailer body in either format.
- ds4-agent names a session file by the SHA1 of its rendered transcript, as
  kvstore does, and keeps no title in it (there is no ds4 title trailer at
  this commit): its /list shows the first user turn, cut to 70 bytes
  (session_title).  That is prompt text: shown only when asked.

Reference vectors written and read back by ds4's own code are in
tests/ds4/vectors/ (tests/ds4/generate.py names the commit).
"""

import struct

from kvstore.format import ExtFlag

__all__ = ["DS4_ABIS", "KTM_MAGIC", "is_ds4", "is_tool_map", "parse_tool_map", "encode_tool_map",
           "session_title"]

DS4_ABIS = frozenset({0, 2})
KTM_MAGIC = b"KTM\x01"                   # magic and version 1
_KTM_HEAD = struct.Struct("<4sI")
_KTM_LENS = struct.Struct("<II")
# ds4-server's loader refuses ids longer than this.
MAX_ID_BYTES = 256

# ds4-agent's title: the first user turn, its whitespace runs as one space, at
# most TITLE_BYTES bytes, then "..." when cut (agent_session_title_from_text).
_USER, _ASSISTANT = "<｜User｜>".encode(), "<｜Assistant｜>".encode()
TITLE_BYTES = 70
_WHITE = b" \t\n\v\f\r"                # C's isspace()


def is_ds4(entry):
    """True for a file ds4 wrote (a whole file of a ds4 payload ABI)."""
    return not entry.is_block and not entry.sealed and entry.payload_abi in DS4_ABIS


def is_tool_map(trailer):
    """True when trailer bytes open with ds4's KTM magic (never a kvstore trailer's first byte)."""
    return bytes(trailer[:len(KTM_MAGIC)]) == KTM_MAGIC


def parse_tool_map(trailer):
    """{tool-call id: DSML text} of a ds4 KTM trailer, in file order.

    Raises:
        ValueError: not a KTM trailer, or a count, length or id that ds4's own
            loader would stop at (the message names which; never the content).
    """
    view = memoryview(trailer).cast("B")
    if len(view) < _KTM_HEAD.size or not is_tool_map(view):
        raise ValueError("not a ds4 tool map (no KTM v1 magic)")
    _, count = _KTM_HEAD.unpack_from(view)
    at, out = _KTM_HEAD.size, {}
    for i in range(count):
        if len(view) - at < _KTM_LENS.size:
            raise ValueError(f"ds4 tool map entry {i} of {count}: truncated lengths")
        id_len, dsml_len = _KTM_LENS.unpack_from(view, at)
        at += _KTM_LENS.size
        if not 0 < id_len <= MAX_ID_BYTES or dsml_len == 0 or id_len + dsml_len > len(view) - at:
            raise ValueError(f"ds4 tool map entry {i} of {count}: id {id_len} and DSML {dsml_len} bytes "
                             f"do not fit the {len(view) - at} left")
        out[bytes(view[at:at + id_len]).decode("utf-8")] = bytes(view[at + id_len:at + id_len + dsml_len]).decode(
            "utf-8")
        at += id_len + dsml_len
    return out


def encode_tool_map(pairs):
    """ds4's KTM bytes for (id, DSML) pairs, in that order (a trailer ds4-server loads).

    Raises:
        ValueError: an empty or too long id, or an empty DSML text.
    """
    pairs = list(pairs.items() if isinstance(pairs, dict) else pairs)
    parts = [_KTM_HEAD.pack(KTM_MAGIC, len(pairs))]
    for tool_id, dsml in pairs:
        i, d = tool_id.encode("utf-8"), dsml.encode("utf-8")
        if not 0 < len(i) <= MAX_ID_BYTES or not d:
            raise ValueError(f"a ds4 tool map id must be 1 to {MAX_ID_BYTES} bytes and its DSML non-empty "
                             f"(got {len(i)} and {len(d)} bytes)")
        parts += [_KTM_LENS.pack(len(i), len(d)), i, d]
    return b"".join(parts)


def session_title(text):
    """The title ds4-agent's /list shows for a session whose rendered transcript is text (bytes).

    ds4's rule, quirk included: a space is kept only while one more byte
    fits, so a word that starts at the last byte is joined to the one before.
    """
    start = text.find(_USER)
    if start < 0:
        return "(no user prompt)"
    start += len(_USER)
    ends = [i for i in (text.find(_ASSISTANT, start), text.find(_USER, start)) if i >= 0]
    out, space = bytearray(), False
    for c in text[start:min(ends, default=len(text))].strip(_WHITE):
        if c in _WHITE:
            space = bool(out)
            continue
        if space and len(out) + 1 < TITLE_BYTES:
            out += b" "
            space = False
        if len(out) >= TITLE_BYTES:
            return out.decode("utf-8", "replace") + "..."
        out.append(c)
    return out.decode("utf-8", "replace") if out else "(empty user prompt)"


# The ext bits ds4 gives meaning to, for listings.
EXT_NAMES = {ExtFlag.TOOL_MAP: "tool-map", ExtFlag.RESPONSES_VISIBLE: "responses-visible",
             ExtFlag.THINKING_VISIBLE: "thinking-visible"}
