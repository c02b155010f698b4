"""A tiny random LLaMA for onnxruntime-genai's model builder (no download) and tokens.npz for
``revgraph train --loss-fn causal-lm``: the builder's inputs, an empty KV cache. README: "LoRA on an int4 LLM from
onnxruntime-genai's builder"; run.sh runs the whole walk-through."""

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models

# head size 16 (GroupQueryAttention needs >= 16); vocabulary != intermediate_size (else the builder takes the MLP's
# weight for the LM head)
cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
torch.manual_seed(0)
transformers.LlamaForCausalLM(cfg).save_pretrained("hf")
tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(256)}, unk_token="t0"))
transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                     eos_token="t2").save_pretrained("hf")
ids = np.random.default_rng(0).integers(3, 256, (8, 16))  # 8 sequences of 16 tokens
np.savez("tokens.npz", input_ids=ids, attention_mask=np.ones_like(ids),
         **{f"past_key_values.{i}.{kv}": np.zeros((8, 2, 0, 16), np.float32)
            for i in range(2) for kv in ("key", "value")})
