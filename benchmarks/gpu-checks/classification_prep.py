"""Prepared here on CPU, checked on the GPU: a tiny DistilBERT classifier (WordPiece, [CLS]/[SEP]), the
review data of one site, its classification shards and manifest."""

import sys
from pathlib import Path

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from transformers import DistilBertConfig, DistilBertForMaskedLM, PreTrainedTokenizerFast

from fedtune.download.demo_data import write_reviews
from fedtune.download.fetch import download_data, download_model
from fedtune.download.options import DatasetOptions, ModelOptions
from fedtune.tokenize.options import TokenizeOptions
from fedtune.tokenize.shards import ShardJob, tokenize_shard, write_manifest

w = Path(sys.argv[1])
write_reviews(w / "reviews")
spec = {
    "source": "local",
    "data_files": {s: str(w / "reviews/alpha" / f"{s}.jsonl") for s in ("train", "test")},
}
download_data(DatasetOptions.from_mapping(spec), w / "raw", num_labels=3)

texts = [line for line in (w / "reviews/alpha/train.jsonl").read_text().splitlines()]
tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
tok.normalizer = normalizers.BertNormalizer(lowercase=True)
tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials))
tok.post_processor = processors.TemplateProcessing(
    single="[CLS] $A [SEP]",
    special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
)
fast = PreTrainedTokenizerFast(
    tokenizer_object=tok,
    pad_token="[PAD]",
    unk_token="[UNK]",
    cls_token="[CLS]",
    sep_token="[SEP]",
    mask_token="[MASK]",
)
config = DistilBertConfig(
    vocab_size=len(fast),
    dim=64,
    hidden_dim=128,
    n_layers=2,
    n_heads=2,
    max_position_embeddings=64,
    pad_token_id=fast.pad_token_id,
)
body = w / "body"
DistilBertForMaskedLM(config).save_pretrained(body)
fast.save_pretrained(body)
download_model(
    ModelOptions.from_mapping({"source": "hf", "name": str(body), "num_labels": 3}),
    w / "model",
    task="sequence-classification",
)
shard = w / "data/train/shard-0"
options = TokenizeOptions.from_mapping({"shards": 1, "block_size": 32, "task": "sequence-classification"})
tokenize_shard(ShardJob(w / "raw", "train", 0, w / "model", shard), options)
write_manifest([shard], w / "data/manifest.json")
print("prepared", w)
