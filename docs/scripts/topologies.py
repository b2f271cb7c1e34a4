"""Draw each built-in topology and tabulate its spectral gap, from the code in lightning_decentral.topology.

    python docs/scripts/topologies.py      # writes docs/img/topologies/*.png and docs/topologies_table.md

tests/test_examples.py checks that the committed table equals what the code computes now.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lightning_decentral.topology import TOPOLOGIES, Hierarchical, Topology

DOCS = Path(__file__).resolve().parents[1]
TABLE = DOCS / "topologies_table.md"
IMAGES = DOCS / "img" / "topologies"
SIZES = (4, 8, 16, 32, 64)
DRAWN_SIZE = 8
EXAMPLE_ARGS = {"hierarchical": {"ranks_per_node": 4}}  # a multi-node layout; on one node it would be `inner`
DRAWN_SIZES = {"hierarchical": 16}
DRAWN_ARGS = {"random_matching": {"period": 4}}  # four of its draws (the first four steps: period 64 draws them too)


def build(name: str, world_size: int, **extra: object) -> Topology:
    """``TOPOLOGIES[name]`` on ``world_size`` ranks, with the example arguments above (and ``extra``)."""
    return TOPOLOGIES[name](world_size=world_size, **EXAMPLE_ARGS.get(name, {}), **extra)


def label(name: str) -> str:
    extra = ", ".join(f"{key}={value}" for key, value in EXAMPLE_ARGS.get(name, {}).items())
    return f"`{name}`" + (f" ({extra})" if extra else "")


def factors(topology: Topology, step: int) -> list[np.ndarray]:
    """The matrices the gossip engine exchanges one after the other: ``I_N ⊗ W_in`` and ``W_out ⊗ I_m``
    for a hierarchical topology, else ``W(step)`` alone."""
    if not isinstance(topology, Hierarchical):
        return [topology.mixing(step)]
    return [level.matrix(step, topology.world_size) for level in topology.levels()]


def messages_per_step(topology: Topology) -> str:
    """Point-to-point messages each rank sends per gossip round, averaged over one period ("all-reduce" for 11ᵀ/n);
    for a hierarchical topology, inside the node + across nodes."""
    if isinstance(topology, Hierarchical):
        inner, outer = (level.parts[0] for level in topology.levels())
        return f"{messages_per_step(inner)} in the node + {messages_per_step(outer)} across"
    if all(topology.is_average(step) for step in range(topology.period)):
        return "1 all-reduce"
    sent = [
        len(topology.out_neighbors(rank, step))
        for step in range(topology.period)
        for rank in range(topology.world_size)
    ]
    return f"{np.mean(sent):g}"


def table() -> str:
    """The markdown table: the spectral gap ``1 - rho`` per step of each topology, and its messages per step."""
    head = "| topology | " + " | ".join(f"n = {n}" for n in SIZES) + " | messages per rank per step (n = 16) |"
    rule = "|---" * (len(SIZES) + 2) + "|"
    rows = []
    for name in TOPOLOGIES:
        gaps = [f"{build(name, n).spectral_gap():.4f}" for n in SIZES]
        rows.append(f"| {label(name)} | " + " | ".join(gaps) + f" | {messages_per_step(build(name, 16))} |")
    return "\n".join([head, rule, *rows]) + "\n"


def positions(name: str, topology: Topology) -> dict[int, tuple[float, float]]:
    """Where each rank sits: the torus on its grid, a hierarchical job node by node, the rest on a circle."""
    n = topology.world_size
    if name == "torus":
        rows, cols = topology.grid  # the grid the code chose
        return {r * cols + c: (c, -r) for r in range(rows) for c in range(cols)}
    m = topology.node_size if isinstance(topology, Hierarchical) else 1
    angle = 2 * np.pi * np.arange(n // m) / (n // m)
    local = 2 * np.pi * np.arange(m) / m
    return {
        a * m + i: (
            np.cos(angle[a]) + 0.35 * np.cos(local[i]) * (m > 1),
            np.sin(angle[a]) + 0.35 * np.sin(local[i]) * (m > 1),
        )
        for a in range(n // m)
        for i in range(m)
    }


def draw(name: str, topology: Topology, path: Path) -> None:
    """One panel per distinct ``W(k)``: a line between ``i`` and ``j`` for every ``w_ij > 0``, ``i != j``
    (an arrow ``j -> i`` where only ``i`` hears ``j``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    n = topology.world_size
    panels = topology.period
    where = positions(name, topology)
    fig, axes = plt.subplots(1, panels, figsize=(3.2 * panels, 3.4), squeeze=False)
    for step, ax in enumerate(axes[0]):
        graph = nx.DiGraph()
        graph.add_nodes_from(range(n))
        for w in factors(topology, step):
            graph.add_edges_from((j, i) for i in range(n) for j in range(n) if i != j and w[i, j] > 0)
        symmetric = all(graph.has_edge(b, a) for a, b in graph.edges)
        nx.draw_networkx_nodes(graph, where, ax=ax, node_size=300, node_color="#4f7cac")
        nx.draw_networkx_labels(graph, where, ax=ax, font_color="white", font_size=8)
        nx.draw_networkx_edges(
            graph.to_undirected() if symmetric else graph,
            where,
            ax=ax,
            arrows=True,
            arrowstyle="-" if symmetric else "-|>",
            arrowsize=10,
            node_size=300,
            edge_color="#555555",
            connectionstyle="arc3,rad=0.25" if name == "torus" else "arc3",
        )
        ax.set_title(f"k mod {panels} = {step}" if panels > 1 else f"{name}, n = {n}", fontsize=10)
        ax.set_axis_off()
    if panels > 1:
        fig.suptitle(f"{name}, n = {n}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    TABLE.write_text(table())
    IMAGES.mkdir(parents=True, exist_ok=True)
    for name in TOPOLOGIES:
        draw(name, build(name, DRAWN_SIZES.get(name, DRAWN_SIZE), **DRAWN_ARGS.get(name, {})), IMAGES / f"{name}.png")
    print(f"wrote {TABLE} and {len(TOPOLOGIES)} pictures in {IMAGES}")


if __name__ == "__main__":
    main()
