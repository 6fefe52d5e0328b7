"""Files on disk: finding, reading, checking and writing checkpoint folders. Imports nothing above it.

- ``source``: resolve a source (directory, bundled example, hub id) and read its config and tensors.
- ``hub``: downloads from the Hugging Face Hub.
- ``pickle_io``: ``.bin`` state dicts read with ``weights_only`` and held to the dtype policy.
- ``bounded``: the one bounded reader of JSON, YAML and text files (size, depth, digits, aliases, shape).
- ``side_files``: a checkpoint's processor, generation and other JSON files checked against its config.
- ``safetensors_io``: the safetensors format: headers, positioned reads, the streaming writer's pieces.
- ``reads``: the writer's cache of recent tensor reads.
- ``names``: checkpoint tensor names to the model class's, and the file names normswap writes.
- ``provenance``: a typed view of the ``normswap`` block of a config, read once and passed down.
- ``rotations``: one record per rotation method, and the rotation forms.
- ``validation``: config.json checked against itself and its weight headers, before any work.
- ``output``: output folders claimed before any work and installed atomically.
- ``marker``: the ``.normswap-output`` marker: an output's kind and every path normswap wrote.
- ``renames``: the renames that install an output.
- ``journal``: the install's journal, which the next run repairs a kill between renames from.
- ``temporaries``: temporary output folders (marked with a token) and the removal of stale ones.
- ``files``: the files read or copied from a checkpoint, each a regular file inside it.
- ``removal``: removing an old output without following links or leaving its filesystem.
- ``space``: free space for an output, and the progress of writing it.
- ``tokenizer_panics``: a tokenizer's Rust panic as one line, and tokenizing under a deadline.
"""
