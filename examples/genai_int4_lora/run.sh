#!/bin/sh
# LoRA fine-tuning of onnxruntime-genai's int4 LLaMA, end to end (README: "LoRA on an int4 LLM from
# onnxruntime-genai's builder"). Run in an empty folder: sh path/to/run.sh. Needs pip install onnxruntime-genai.
set -e
here=$(dirname "$0")
python "$here/make_llama.py"
python -m onnxruntime_genai.models.builder -i hf -o int4 -p int4 -e cpu
revgraph train int4/model.onnx --lora 8 --loss-fn causal-lm --model-output logits --data tokens.npz --max-steps 20 \
    --batch-size 4 --optimizer adam --lr 0.01 -o int4.lora.onnx
revgraph lora extract int4.lora.onnx -o adapters.npz
rm -rf int4-lora && cp -r int4 int4-lora && cp int4.lora.onnx int4-lora/model.onnx
python "$here/generate.py" int4       # the base model's greedy tokens
python "$here/generate.py" int4-lora  # the fine-tuned one's
