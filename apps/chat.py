"""Terminal chat across two models: the same as `kvlingo chat`.

python apps/chat.py                       # the demo pair
python apps/chat.py --source S --target T --translator F [--backward-translator B]
"""

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.cli.chat import chat_cmd

if __name__ == "__main__":
    chat_cmd(prog_name="chat")
