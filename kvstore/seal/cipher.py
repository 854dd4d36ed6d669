"""The AEAD under sealed files: HKDF-SHA256 and AES-256-GCM over one chunk.

The only module that imports ``cryptography`` (which calls OpenSSL; no
cipher is written here, and it releases the GIL while OpenSSL runs, so the
I/O threads encrypt and decrypt in parallel).  It is an optional extra,
``kvstore[seal]``: without it this module still imports, and
require_crypto() says what to install.  Which nonce and AAD a chunk gets is
the layout's (kvstore.seal.layout); this module only runs the cipher.
"""

from kvstore.payload.buffers import thread_scratch
from kvstore.seal.layout import CHUNK_BYTES

try:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
except ImportError as e:          # an optional extra: kvstore[seal]
    CRYPTO_MISSING = e
else:
    CRYPTO_MISSING = None

DERIVED_KEY_BYTES = 32            # AES-256

# The zeros between a chunk's pieces (a writer's gaps: padding).
_ZEROS = bytes(CHUNK_BYTES)



def require_crypto():
    """Raises ImportError, naming the extra to install, when ``cryptography`` is missing."""
    if CRYPTO_MISSING is not None:
        raise ImportError("sealed stores need the cryptography package: pip install 'kvstore[seal]'") \
            from CRYPTO_MISSING


def derive_key(ikm, info, salt=None):
    """A 32-byte key for one purpose: HKDF-SHA256(ikm, salt, info)."""
    return HKDF(algorithm=hashes.SHA256(), length=DERIVED_KEY_BYTES, salt=salt, info=info).derive(ikm)


def encrypt_pieces(key, nonce, aad, pieces, out):
    """Encrypts one chunk into out (a writable memoryview of the chunk's
    length): its plain bytes are pieces, (offset, memoryview) in order, with
    zeros between them and after the last.

    Returns:
        the chunk's 16-byte GCM tag.
    """
    enc = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    enc.authenticate_additional_data(aad)
    done = 0
    for at, part in [*pieces, (out.nbytes, memoryview(b""))]:
        if at > done:
            enc.update_into(memoryview(_ZEROS)[:at - done], out[done:at])
        if part.nbytes:
            enc.update_into(part, out[at:at + part.nbytes])
        done = at + part.nbytes
    enc.finalize()
    return enc.tag


def decrypt_parts(key, nonce, tag, aad, parts):
    """Decrypts one chunk whose ciphertext lies in parts (writable
    memoryviews, in order) and checks its tag; each part then holds its
    plain bytes.

    The plain bytes go through this thread's scratch and reach the parts
    only once the tag has checked (cryptography 51 refuses to decrypt a
    buffer into itself): a forged chunk leaves no plain byte in them.

    Returns:
        True when the chunk authenticates; False when it does not, every
        part and the scratch then wiped.
    """
    dec = Cipher(algorithms.AES(key), modes.GCM(nonce, tag)).decryptor()
    dec.authenticate_additional_data(aad)
    plain = thread_scratch("plain", sum(p.nbytes for p in parts))
    at = 0
    for part in parts:
        dec.update_into(part, plain[at:at + part.nbytes])
        at += part.nbytes
    try:
        dec.finalize()
    except InvalidTag:
        plain[:] = bytes(plain.nbytes)
        for part in parts:
            part[:] = bytes(part.nbytes)
        return False
    at = 0
    for part in parts:
        part[:] = plain[at:at + part.nbytes]
        at += part.nbytes
    return True


def decrypt_in_place(key, nonce, tag, aad, part):
    """decrypt_parts of a chunk whose ciphertext is one part."""
    return decrypt_parts(key, nonce, tag, aad, [part])
