"""The decoding core: prefill, tree verification and KV compaction (one request, or many in flight), what a step
costs, and the trees and rows the engines and drafters pass each other. It knows nothing about tokenization or
files: adapters build the prompts, drafters the trees, the session drives it."""
