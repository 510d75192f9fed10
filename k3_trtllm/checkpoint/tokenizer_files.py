"""The tokenizer and generation files a checkpoint carries besides its tensors, which
``convert`` copies into the converted checkpoint so that ``run``/``serve`` on it use the
real tokenizer instead of falling back to bytes."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..utils.atomic import write_file
from .errors import CheckpointError

# tiktoken.model + tokenizer_config.json are K3's tokenizer (runtime/tokenizer.py); the
# others are what Hugging Face tokenizers and generation configs keep beside them.
TOKENIZER_FILES = (
    "tiktoken.model", "tokenizer_config.json", "tokenizer.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "generation_config.json",
)
MAX_FILE_BYTES = 1 << 30  # tokenizer files are megabytes; a larger one is no tokenizer file


def find_tokenizer_files(model_dir: str | Path, check_inside: Callable[[Path, str], None]) -> list[Path]:
    """The TOKENIZER_FILES present in ``model_dir``, each checked by ``check_inside(path,
    what)`` (which raises for a link out of the checkpoint) and refused unless a regular
    file of sane size: the checkpoint is untrusted, and its files are copied."""
    found = []
    for name in TOKENIZER_FILES:
        path = Path(model_dir) / name
        if not path.exists() and not path.is_symlink():
            continue
        what = f"{path}: tokenizer file"
        check_inside(path, what)
        if not path.is_file():
            raise CheckpointError(f"{what} is not a regular file")
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise CheckpointError(f"{what} holds {size} bytes, more than {MAX_FILE_BYTES} (not a tokenizer file)")
        found.append(path)
    return found


def copy_tokenizer_files(files: list[Path], out_dir: Path) -> None:
    """Copy ``files`` (from find_tokenizer_files) into ``out_dir`` under their names, as
    regular files (a link would point back into the input)."""
    for path in files:
        write_file(out_dir / path.name, path.read_bytes())
