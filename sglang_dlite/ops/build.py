"""Build the compiled draft-step ops (csrc/). Interim: no kernels exist yet, nothing to build."""

if __name__ == "__main__":
    print("sglang_dlite.ops.build: no compiled ops in this build; the torch reference is used.")
