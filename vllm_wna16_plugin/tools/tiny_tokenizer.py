"""A tiny byte-level BPE tokenizer, built offline and deterministically, for test checkpoints.

`save_tiny_tokenizer(out_dir)` writes tokenizer.json, tokenizer_config.json (with a
chat template) and special_tokens_map.json, loadable by
`transformers.AutoTokenizer.from_pretrained(out_dir)` with no network. Byte-level
pre-tokenization and decoding make every string round-trip (no unknown tokens); the
merges are trained on a fixed built-in word list, so the files are identical on
every run. The vocabulary is at most `TINY_VOCAB_SIZE` entries.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

TINY_VOCAB_SIZE = 512  # the trainer's target, special tokens included

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END)  # ids 0..4 in this order

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = """
the of and to in is it you that he was for on are with as his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw
far sea draw left late run while press close night real life few north open seem together next
white children begin got walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better
true during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power town
fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct
able pound done beauty drive stood contain front teach week final gave green oh quick develop ocean
warm free minute strong special mind behind clear tail produce fact street inch multiply nothing
course stay wheel full force blue object decide surface deep moon island foot system busy test
record boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape
equate miss brought heat snow tire bring yes distant fill east paint language among hello model
token expert mixture quantize weight scale zero group channel kernel tensor layer attention
""".split()

_PUNCTUATION = ". , ! ? ; : ' \" ( ) - 0 1 2 3 4 5 6 7 8 9 10 100 2024".split()


def _corpus() -> list[str]:
    """Fixed training text: each word alone, capitalised, and in short phrases."""
    lines = [" ".join(_WORDS[i : i + 12]) for i in range(0, len(_WORDS), 12)]
    lines += [" " + w for w in _WORDS] + [w.capitalize() for w in _WORDS[:200]]
    lines += [" ".join(_PUNCTUATION)]
    return lines


@functools.lru_cache(maxsize=1)
def tiny_tokenizer_json() -> str:
    """The tokenizer.json text (a `tokenizers` byte-level BPE); cached, deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok.to_str()


def tiny_vocab_size() -> int:
    """Number of entries in the tiny tokenizer's vocabulary (special tokens included)."""
    return len(json.loads(tiny_tokenizer_json())["model"]["vocab"])


def special_token_ids() -> dict[str, int]:
    """{"pad": id, "bos": id, "eos": id}."""
    vocab = json.loads(tiny_tokenizer_json())["model"]["vocab"]
    return {"pad": vocab[PAD_TOKEN], "bos": vocab[BOS_TOKEN], "eos": vocab[EOS_TOKEN]}


def save_tiny_tokenizer(out_dir: str | Path, *, model_max_length: int = 4096) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tiny_tokenizer_json(), encoding="utf-8")
    vocab = json.loads(tiny_tokenizer_json())["model"]["vocab"]
    added = {
        str(vocab[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")
    return out
