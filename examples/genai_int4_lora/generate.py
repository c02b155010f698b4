"""Greedy generation by onnxruntime-genai from a builder folder: ``python generate.py FOLDER``."""

import sys

import numpy as np
import onnxruntime_genai as og

model = og.Model(sys.argv[1])
params = og.GeneratorParams(model)
params.set_search_options(max_length=12, do_sample=False)
gen = og.Generator(model, params)
gen.append_tokens(np.array([[5, 6, 7, 8]], np.int32))
while not gen.is_done():
    gen.generate_next_token()
print(gen.get_sequence(0).tolist())
