"""revgraph's tools: gradient checking, lifting constants, pictures, the demo."""
