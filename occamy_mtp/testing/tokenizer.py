"""A small Qwen-style tokenizer, trained here, for tests, benchmarks and the demo.

Real Qwen3.5 tokenizers are 248k-token byte-level BPEs whose files cannot be downloaded
at test time. This builder trains a byte-level BPE of the same construction (Qwen's
pre-tokenizer regex, NFC normalisation, byte-level decoding) on the shipped sample
conversations, adds Qwen's chat tokens at the END of the vocabulary (where Qwen puts
them), and writes a directory that `transformers.AutoTokenizer.from_pretrained` loads
offline. Its chat template mimics Qwen3.5's (see `CHAT_TEMPLATE`), so that window
building is exercised on the rendering a served Qwen3.5 model really sees.

Everything is deterministic: the same corpus and vocab size give byte-identical files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Where the shipped sample conversations live (repository layout: occamy_mtp/testing/ -> data/).
SAMPLE_DATA_PATH = Path(__file__).resolve().parents[2] / "data" / "sample.jsonl"

DEFAULT_VOCAB_SIZE = 1024  # the tiny test models' vocab_size (occamy_mtp.testing.checkpoints)

# Qwen2/2.5/3/3.5's pre-tokenizer split: contractions, letter runs with one leading
# non-letter, single digits, punctuation runs, newline runs, other whitespace.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

ENDOFTEXT = "<|endoftext|>"  # Qwen's pad token (and document separator in pretraining)
IM_START = "<|im_start|>"  # opens a chat turn
IM_END = "<|im_end|>"  # closes a chat turn; the chat models' eos
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# Control tokens are "special" (skipped by decode(skip_special_tokens=True)); the think
# tags are added tokens that are NOT special, as in the real Qwen3/3.5 tokenizer_config,
# so a decoded answer keeps them.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
THINK_TOKENS = (THINK_OPEN, THINK_CLOSE)
ADDED_TOKENS = SPECIAL_TOKENS + THINK_TOKENS

# Mimics Qwen3.5's template for text: a leading system turn, `<|im_start|>{role}\n
# {content}<|im_end|>\n` per turn, content trimmed; an assistant turn after the last
# user query is rendered with its think block (empty when it has no reasoning), earlier
# assistant turns without one (Qwen3 drops old reasoning from history). The generation
# prompt is `<|im_start|>assistant\n` followed by `<think>\n` (thinking on, the default)
# or by an empty think block `<think>\n\n</think>\n\n` under enable_thinking=false.
# Consequence that window building relies on: the rendering of messages[:k+1] whose last
# message is an assistant turn starts with the rendering of messages[:k] plus the
# enable_thinking=false generation prompt, so the answer span is exactly the rest.
# Earlier assistant turns in a FULL conversation render without the think block, so a
# window for turn k must be built from messages[:k+1], never from the whole conversation.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is none -%}
    {%- elif content is iterable and content is not mapping -%}
        {%- for item in content -%}
            {%- if item.type == 'text' -%}
                {{- item.text -}}
            {%- else -%}
                {{- raise_exception('This template renders text content parts only.') -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- raise_exception('Unexpected message content type.') -}}
    {%- endif -%}
{%- endmacro -%}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- set ns = namespace(last_query_index=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query_index = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if ns.last_query_index < 0 %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content)|trim %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
        {{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- set content = content|trim %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""


def sample_corpus(path: Path = SAMPLE_DATA_PATH) -> Iterator[str]:
    """Every message content of the shipped sample conversations, in file order."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: the sample conversations are missing; pass corpus= explicitly or "
            "rebuild them with scripts/build_sample_data.py"
        )
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            for message in json.loads(line)["messages"]:
                yield message["content"]


def build_tokenizer(out_dir: Path, *, vocab_size: int = DEFAULT_VOCAB_SIZE, corpus: Iterable[str] | None = None,
                    special_markers: bool = False) -> Path:
    """Train a byte-level BPE and write a directory AutoTokenizer loads offline.

    `vocab_size` is the TOTAL size including the five added tokens, so a model with
    `vocab_size` embeddings covers every id. The learned tokens come first (ids
    0..vocab_size-6, the 256 byte symbols among them), then `<|endoftext|>`,
    `<|im_start|>`, `<|im_end|>`, `<think>`, `</think>`. If a small `corpus` supports
    fewer merges than asked for, the vocabulary is smaller (never larger) and the added
    tokens follow the learned ones; `added_token_ids` gives their ids either way.
    `corpus` defaults to the shipped sample conversations (data/sample.jsonl). With `special_markers`
    the think tags are registered as special tokens, as some families' tokenizers do (Qwen's do not).
    Returns `out_dir`.
    """
    learned_size = vocab_size - len(ADDED_TOKENS)
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    if learned_size < len(byte_alphabet):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs {len(byte_alphabet)} byte "
            f"symbols plus {len(ADDED_TOKENS)} added tokens"
        )
    texts = list(sample_corpus() if corpus is None else corpus)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=learned_size,
        initial_alphabet=byte_alphabet,  # every byte is a token: nothing is ever unknown
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    if special_markers:
        tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in THINK_TOKENS])
    else:
        tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in THINK_TOKENS])

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "model_max_length": 262144,  # Qwen3.5's context length
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": IM_END, "pad_token": ENDOFTEXT}, indent=2) + "\n", encoding="utf-8"
    )
    return out_dir


def added_token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """Ids of the five added tokens (`<|endoftext|>`, ..., `</think>`) of a built tokenizer."""
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in ADDED_TOKENS}
    missing = [token for token, token_id in ids.items() if token_id is None]
    if missing:
        raise ValueError(f"{tokenizer_dir}: not a tokenizer from build_tokenizer (missing {missing})")
    return ids
