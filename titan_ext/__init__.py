if __name__ == "titan_ext":  # the checkout's folder imported by its own name: not the installed package
    raise ImportError("import composer_mesh.titan_ext, not titan_ext: the packages install as composer_mesh.* "
                      "(python3 -m mesh.bootstrap setup; docs/installation.md)")
