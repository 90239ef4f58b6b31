"""The `pdserve` command: parses its arguments and hands each subcommand to its package.

`serve` starts the router (router/launch.py); `generate`, `chat`, `status`, `scale` talk to a
running router (client/); `bench`, `inspect`, `plan` are the measuring toolkit (bench/);
`convert-gguf` makes a checkpoint (checkpoints/).
"""
