"""Runtime T5 caption encoding, producing what LlamaGen's t2i models were trained on (flan-t5-xl, 2048-d, 120 tokens).

    enc = T5CaptionEncoder("/models/flan-t5-xl", max_length=120, device="cuda", dtype="bfloat16")
    batch = enc.encode(["A red bus parked on a city street."])
    batch.emb   # [B, 120, 2048] float32, LEFT-padded: zeros first, the caption's tokens (EOS included) at the end
    batch.mask  # [B, 120] bool, True at the real tokens (right-aligned)

What LlamaGen does, and this module does the same way (our own code, from reading its `language/t5.py` and
`autoregressive/sample/sample_t2i.py`):
- each caption is cleaned twice by its caption-cleaning rules (`clean_caption`: URL-decoding, lower case, URLs,
  HTML tags and entities, @names, CJK blocks, dash / quote unification, IP addresses, ids and file names, runs of
  punctuation, ...);
- the T5 tokenizer pads to `max_length` (120), with its special tokens (the `</s>` EOS), and the encoder's
  `last_hidden_state` is the embedding, computed under the given dtype (LlamaGen: bfloat16 on the GPU);
- the sampling script moves each caption's valid tokens to the end (left padding), flips the mask and multiplies
  the embeddings by it, so padded positions are exact zeros.
Differences: LlamaGen truncates a caption of more than 120 tokens (EOS included); here it is refused with
`ciar.text.CaptionTooLongError`, the caption contract of every encoder (`ciar.text`'s docstring says why). LlamaGen's
cleaning runs `ftfy.fix_text` and BeautifulSoup's HTML-to-text; here `html.unescape` and a tag-stripping regex stand
in (the same on ordinary captions; mojibake repair is not done). Nothing is downloaded: the folder must hold the
model and its tokenizer (`save_pretrained` layout).
"""

from __future__ import annotations

import html
import os
import re
import urllib.parse

import torch

from ciar.text import CaptionBatch, check_caption_lengths, checked_captions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_URL = re.compile(r"\b((?:https?:(?:/{1,3}|[a-z0-9%])|[a-z0-9.\-]+[.](?:com|co|ru|net|org|edu|gov|it)[\w/-]*\b/?(?!@)))")
_WWW = re.compile(r"\b((?:www:(?:/{1,3}|[a-z0-9%])|[a-z0-9.\-]+[.](?:com|co|ru|net|org|edu|gov|it)[\w/-]*\b/?(?!@)))")
_CJK = re.compile("[\u31c0-\u31ef\u31f0-\u31ff\u3200-\u32ff\u3300-\u33ff\u3400-\u4dbf\u4dc0-\u4dff\u4e00-\u9fff]+")
_DASHES = re.compile("[\u002d\u058a\u05be\u1400\u1806\u2010-\u2015\u2e17\u2e1a\u2e3a\u2e3b\u2e40\u301c\u3030\u30a0"
                     "\ufe31\ufe32\ufe58\ufe63\uff0d]+")
_BAD_PUNCT = re.compile(r"[#®•©™&@·º½¾¿¡§~)(\]\[}{|\\/*]+")
# (pattern, replacement), applied in order after the URL / HTML / CJK / dash steps
_RULES = [
    (r"@[\w\d]+\b", ""),  # @nicknames
    (r"[`´«»“”¨]", '"'), (r"[‘’]", "'"),  # one kind of quotes
    (r"&quot;?", ""), (r"&amp", ""),
    (r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}", " "),  # IP addresses
    (r"\d:\d\d\s+$", ""),  # article ids
    (r"\\n", " "),
    (r"#\d{1,3}\b", ""), (r"#\d{5,}\b", ""), (r"\b\d{6,}\b", ""),
    (r"[\S]+\.(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)", ""),  # file names
    (r"[\"']{2,}", '"'), (r"[.]{2,}", " "),
]
_TAIL_RULES = [
    (r"\b[a-zA-Z]{1,3}\d{3,15}\b", ""), (r"\b[a-zA-Z]+\d+[a-zA-Z]+\b", ""), (r"\b\d+[a-zA-Z]+\d+\b", ""),
    (r"(worldwide\s+)?(free\s+)?shipping", ""), (r"(free\s)?download(\sfree)?", ""),
    (r"\bclick\b\s(?:for|on)\s\w+", ""), (r"\b(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)(\simage[s]?)?", ""),
    (r"\bpage\s+\d+\b", ""), (r"\b\d*[a-zA-Z]+\d+[a-zA-Z]+\d+[a-zA-Z\d]*\b", " "),
    (r"\b\d+\.?\d*[xх×]\d+\.?\d*\b", ""),
    (r"\b\s+\:\s+", ": "), (r"(\D[,\./])\b", r"\1 "), (r"\s+", " "),
]
_EDGE_RULES = [(r"^[\"']([\w\W]+)[\"']$", r"\1"), (r"^['_,\-:;]", ""), (r"['_,\-:\-+]$", ""), (r"^\.\S+$", "")]


def _clean_once(caption: str) -> str:
    c = urllib.parse.unquote_plus(str(caption)).strip().lower()
    c = c.replace("<person>", "person")
    c = _WWW.sub("", _URL.sub("", c))
    c = html.unescape(re.sub(r"<[^<>]*>", "", c))  # HTML -> its text (tags dropped, entities decoded)
    c = _CJK.sub("", c)
    c = _DASHES.sub("-", c)
    for pattern, repl in _RULES:
        c = re.sub(pattern, repl, c)
    c = _BAD_PUNCT.sub(" ", c)
    c = re.sub(r"\s+\.\s+", " ", c)
    if len(re.findall(r"[-_]", c)) > 3:  # this-is-my-cute-cat
        c = re.sub(r"[-_]", " ", c)
    c = html.unescape(html.unescape(c)).strip()
    for pattern, repl in _TAIL_RULES:
        c = re.sub(pattern, repl, c)
    for pattern, repl in _EDGE_RULES:
        c = re.sub(pattern, repl, c)
    return c.strip()


def clean_caption(caption: str) -> str:
    """LlamaGen's caption cleaning, applied twice as its T5 embedder does."""
    return _clean_once(_clean_once(caption))


class T5CaptionEncoder:
    """A local T5 encoder folder -> LlamaGen's caption layout (see the module docstring). Same interface and caption
    contract as `ciar.text.TextEncoder` (`encode`, `count_tokens`, `max_length`, `dim`, `device`; a caption over
    `max_length` tokens raises `ciar.text.CaptionTooLongError`)."""

    def __init__(self, path: str, max_length: int = 120, device: str | torch.device = "cpu", dtype: str = "float32",
                 preprocess: bool = True):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"T5 folder not found: {path}")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path}: no config.json (expected a transformers T5 folder written by "
                                    f"save_pretrained: config, weights and tokenizer files)")
        from transformers import AutoTokenizer, T5EncoderModel

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise FileNotFoundError(f"{path}: cannot load its T5 tokenizer ({e})") from None
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.model = _load_encoder(T5EncoderModel, path, self.dtype).eval().to(self.device)
        self.max_length, self.preprocess, self.path = int(max_length), preprocess, path
        self.dim = self.model.config.d_model

    def _text(self, caption: str) -> str:
        return clean_caption(caption) if self.preprocess else caption.lower().strip()

    def count_tokens(self, caption: str) -> int:
        """Tokens of the cleaned caption with its EOS (what the caption contract compares to `max_length`)."""
        return len(self.tokenizer(self._text(caption), add_special_tokens=True)["input_ids"])

    @torch.inference_mode()
    def encode(self, captions: list[str], batch_size: int = 64) -> CaptionBatch:
        captions = checked_captions(captions)
        embs, masks = [], []
        for s in range(0, len(captions), batch_size):
            chunk = captions[s:s + batch_size]
            texts = [self._text(c) for c in chunk]
            counted = self.tokenizer(texts, add_special_tokens=True)["input_ids"]
            check_caption_lengths(chunk, [len(ids) for ids in counted], self.max_length)
            tok = self.tokenizer(texts, max_length=self.max_length, padding="max_length", truncation=False,
                                 add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
            ids, att = tok["input_ids"].to(self.device), tok["attention_mask"].to(self.device)
            hidden = self.model(input_ids=ids, attention_mask=att).last_hidden_state.float()
            emb, mask = _left_pad(hidden, att.bool())
            embs.append(emb.cpu())
            masks.append(mask.cpu())
        return CaptionBatch(torch.cat(embs), torch.cat(masks))


def _load_encoder(model_class, path: str, dtype: torch.dtype):
    """`model_class.from_pretrained(path, torch_dtype=dtype)` without the stored weights staying in memory when they
    are converted. transformers memory-maps a safetensors file, and the pages a conversion reads stay in the
    process's resident set until the load ends: flan-t5-xl's float32 encoder loaded as bfloat16 peaks at the 4.9 GB
    file plus the 2.4 GB model. So when a floating tensor of the folder's safetensors files is stored in another type
    than `dtype`, the files are opened for positional reads (no map) and handed to transformers as its state dict of
    unread slices, as its own load hands the mapped ones: it reads, converts and places each the same way (the same
    values), and only the model in `dtype` and the tensors in conversion are resident. Weights already in `dtype`
    (or another layout, or a library without positional reads) keep transformers' own load (mapped, nothing read
    until used)."""
    files = _safetensors_files(path)
    readers = _positional_readers(files, dtype) if files else None
    if readers is None:
        return model_class.from_pretrained(path, local_files_only=True, torch_dtype=dtype)
    try:
        state = {k: f.get_slice(k) for f in readers for k in f.keys()}
        config = model_class.config_class.from_pretrained(path, local_files_only=True)
        return model_class.from_pretrained(None, config=config, state_dict=state, torch_dtype=dtype)
    finally:
        for f in readers:
            f.__exit__(None, None, None)


def _safetensors_files(path: str) -> list[str] | None:
    """The safetensors weight files of a `save_pretrained` folder (one file, or the shards its index names)."""
    import json

    single, index = os.path.join(path, "model.safetensors"), os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        with open(index) as f:
            return [os.path.join(path, name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    return None


def _positional_readers(files: list[str], dtype: torch.dtype) -> list | None:
    """`safe_open` readers with positional reads of `files` when a floating tensor in them is stored in another type
    than `dtype` and transformers takes unread slices as a state dict (its 5.x loader); otherwise None."""
    import transformers
    from safetensors import safe_open

    stored = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
    if int(transformers.__version__.split(".")[0]) < 5:
        return None
    try:
        readers = [safe_open(f, framework="pt", backend="pread") for f in files]
    except TypeError:  # an older safetensors: memory-mapped only
        return None
    types = {f.get_slice(k).get_dtype() for f in readers for k in f.keys()}
    converts = any(t != stored and (t == "BF16" or t.startswith("F")) for t in types)  # F64, F32, F16, BF16, F8_*
    if not converts:
        for f in readers:
            f.__exit__(None, None, None)
        return None
    return readers


def _left_pad(hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, L, D] + mask [B, L] -> left-padded (each row's valid tokens moved to the end, zeros before),
    as LlamaGen's sampling script rearranges T5's output."""
    b, length, _ = hidden.shape
    n = mask.sum(dim=1)  # valid tokens per row (a prefix: T5's tokenizer pads on the right)
    shift = (torch.arange(length, device=hidden.device)[None, :] - (length - n)[:, None]) % length
    out = torch.gather(hidden, 1, shift[:, :, None].expand_as(hidden))
    new_mask = torch.arange(length, device=hidden.device)[None, :] >= (length - n)[:, None]
    return out * new_mask[:, :, None], new_mask
