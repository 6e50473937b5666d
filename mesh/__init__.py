import sys

# the checkout's folder imported by its own name is not the installed package; `python3 -m mesh.bootstrap` (which
# sets up that install, importing only the standard library) is the one bare use, and runs while argv[0] is "-m"
if __name__ == "mesh" and sys.argv[:1] != ["-m"]:
    raise ImportError("import composer_mesh.mesh, not mesh: the packages install as composer_mesh.* "
                      "(python3 -m mesh.bootstrap setup; docs/installation.md)")
