if __name__ == "losses":  # the checkout's folder imported by its own name: not the installed package
    raise ImportError("import composer_mesh.losses, not losses: the packages install as composer_mesh.* "
                      "(python3 -m mesh.bootstrap setup; docs/installation.md)")
