// Train revgraph's demo MLP in the browser: run the training-step graph written by
// `revgraph train --save-training-graph` with onnxruntime-web (WASM), feeding each step's outputs (new
// parameters, optimizer state, step + 1) back as the next step's inputs. The files come from prepare.py:
// data/manifest.json says where each array lies in data/state.bin and data/batches.bin, and which output is
// carried to which input ("carried": the <name>.new convention of revgraph.train).
// The losses go into the page (#losses) and window.losses; window.trainingDone is true at the end and
// window.trainingError holds a message if something failed.

"use strict";

window.losses = [];
window.trainingDone = false;
window.trainingError = null;

const ARRAYS = { float32: Float32Array, int64: BigInt64Array, int32: Int32Array };

function show(id, text) {
  document.getElementById(id).textContent = text;
}

async function fetchBytes(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status} (run python prepare.py first)`);
  return response.arrayBuffer();
}

// An ort.Tensor over the bytes of `entry` ({dtype, shape, offset, bytes}) in `buffer` (8-byte aligned
// offsets, little-endian, which is the byte order of WebAssembly and of every browser's typed arrays).
function tensor(buffer, entry) {
  const Type = ARRAYS[entry.dtype];
  if (!Type) throw new Error(`unsupported dtype ${entry.dtype}`);
  const data = new Type(buffer, entry.offset, entry.bytes / Type.BYTES_PER_ELEMENT);
  return new ort.Tensor(entry.dtype, data, entry.shape);
}

async function train() {
  // One thread: several need SharedArrayBuffer, which needs cross-origin isolation headers that a plain
  // `python -m http.server` does not send.
  ort.env.wasm.numThreads = 1;
  // the .wasm and its .mjs loader next to ort.wasm.min.js (an absolute URL: a module specifier must be one)
  ort.env.wasm.wasmPaths = new URL("node_modules/onnxruntime-web/dist/", document.baseURI).href;
  const manifest = await (await fetch("data/manifest.json")).json();
  const [graph, stateBytes, batchBytes] = await Promise.all(
    [manifest.graph, manifest.state_file, manifest.batch_file].map((f) => fetchBytes(`data/${f}`)));
  const session = await ort.InferenceSession.create(graph, { executionProviders: ["wasm"] });

  let feeds = {};
  for (const [name, entry] of Object.entries(manifest.state)) feeds[name] = tensor(stateBytes, entry);
  const lines = [];
  const started = performance.now();
  for (let k = 0; k < manifest.batches.length; k++) {
    show("status", `step ${k + 1} of ${manifest.batches.length}`);
    for (const [name, entry] of Object.entries(manifest.batches[k])) feeds[name] = tensor(batchBytes, entry);
    const results = await session.run(feeds);
    const loss = results[manifest.loss].data[0];
    window.losses.push(loss);
    lines.push(`step ${String(k + 1).padStart(3)}  loss ${loss.toFixed(6)}`);
    show("losses", lines.join("\n"));
    const next = {};
    for (const [input, output] of manifest.carried) next[input] = results[output];
    feeds = next;
  }
  const seconds = (performance.now() - started) / 1000;
  show("status", `done: ${manifest.batches.length} steps of ${manifest.optimizer} (lr ${manifest.lr}, batch ` +
    `${manifest.batch_size}) in ${seconds.toFixed(2)} s; loss ${window.losses[0].toFixed(4)} -> ` +
    `${window.losses[window.losses.length - 1].toFixed(4)}`);
  window.trainingDone = true;
}

train().catch((error) => {
  window.trainingError = String(error && error.stack ? error.stack : error);
  show("status", `failed: ${error}`);
  window.trainingDone = true;
});
