"""ONNX for the warp layers (FlowNet2's FlowWarp, PWC-Net's and LiteFlowNet's Warp): reading an
(N, C, H, W) image at per-pixel float coordinates, one GatherElements per bilinear corner."""
import numpy as np


class OnnxImageSampler:
    """Emits the pieces every warp needs, its node names prefixed by the layer's (`name`, the layer
    being emitted); op, f32 and i64 are the context's (OnnxContext.op/f32/i64)."""

    def __init__(self, ctx, name, image):
        self.ctx, self.name = ctx, name
        self.op, self.f32, self.i64 = ctx.op, ctx.f32, ctx.i64
        _, self.c, self.h, self.w = ctx.shape(image)
        self.flat = self.op("Reshape", [image, self.i64([0, self.c, self.h * self.w])], "flat")

    def channel(self, t, k, hint, **kw):
        """Channel k of an (N, 2, H, W) flow or coordinate map, as (N, 1, H, W)."""
        return self.op("Slice", [t, self.i64([k]), self.i64([k + 1]), self.i64([1])], hint, **kw)

    def pixel_grid(self):
        """(column, row) maps of (1, 1, H, W) as float32 constants."""
        h, w = self.h, self.w
        gy, gx = np.meshgrid(np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32), indexing="ij")
        return (self.ctx.const(gx.reshape(1, 1, h, w), self.name + "_gx"),
                self.ctx.const(gy.reshape(1, 1, h, w), self.name + "_gy"))

    def plus_pixel_grid(self, x, y):
        """(x + column, y + row): a flow's displacement turned into coordinates."""
        gx, gy = self.pixel_grid()
        return self.op("Add", [gx, x], "px"), self.op("Add", [gy, y], "py")

    def pixels(self, row, col, hint, size=None):
        """The image at integer-valued float (row, col) maps of (N, 1, h, w), inside the image; size: the
        maps' (h, w), the image's own by default."""
        h, w = size or (self.h, self.w)
        index = self.op("Add", [self.op("Mul", [row, self.f32(self.w)], hint + "_rw"), col], hint + "_i")
        index = self.op("Cast", [index], hint + "_i64", to=7)   # INT64; exact below 2^24 pixels
        index = self.op("Reshape", [index, self.i64([0, 1, h * w])], hint + "_flat")
        index = self.op("Expand", [index, self.i64([1, self.c, 1])], hint + "_all")
        got = self.op("GatherElements", [self.flat, index], hint, axis=2)
        return self.op("Reshape", [got, self.i64([0, self.c, h, w])], hint + "_img")

    def cuda_taps(self, x, y, out, size=None):
        """optical_flow.bilinear_taps(image, x, y, True) into `out`: for (N, 1, h, w) row maps x and column maps
        y (size; the image's by default), each tap's factor written 1 - (a - b) as the CUDA kernels write it,
        a NaN coordinate's (int) cast 0, taps outside the image 0 (FlowTransformer, jiandao's
        SpatialTransformerPT)."""
        op, f32 = self.op, self.f32
        m0, k0 = op("Floor", [x], "m0"), op("Floor", [y], "k0")
        m1, k1 = op("Add", [m0, f32(1)], "m1"), op("Add", [k0, f32(1)], "k1")

        def weight(a, b, hint):
            return op("Sub", [f32(1), op("Sub", [a, b], "d" + hint)], "w" + hint)

        def index(v, hint):
            return op("Where", [op("IsNaN", [v], hint + "_nan"), f32(0), v], hint + "_i")

        wm0, wm1, wk0, wk1 = weight(x, m0, "m0"), weight(m1, x, "m1"), weight(y, k0, "k0"), weight(k1, y, "k1")
        im0, im1, ik0, ik1 = index(m0, "m0"), index(m1, "m1"), index(k0, "k0"), index(k1, "k1")
        total = None
        for t, (m, k, wm, wk) in enumerate(((im0, ik0, wm0, wk0), (im1, ik0, wm1, wk0), (im0, ik1, wm0, wk1),
                                            (im1, ik1, wm1, wk1))):
            inside = self.within(k, m, f"in{t}", True)      # 0 <= column < W, 0 <= row < H
            row = op("Where", [inside, m, f32(0)], f"row{t}")
            col = op("Where", [inside, k, f32(0)], f"col{t}")
            term = op("Mul", [op("Mul", [wm, wk], f"w{t}"), self.pixels(row, col, f"v{t}", size)], f"t{t}")
            term = op("Where", [inside, term, f32(0)], f"k{t}")
            total = term if total is None else op("Add", [total, term], f"s{t}")
        self.ctx.add_node("Identity", [total], [out], name=self.name + "_out")

    def coords_warp(self, x, y, out, size=None, cell=None):
        """optical_flow.coords_warp into `out`: bilinear samples at absolute (x, y) maps of (N, 1, h, w)
        (size; the image's by default), each neighbour outside the image counting 0.  `cell(t, hint)` gives
        the upper-left neighbour's coordinate (floor by default; a fork's C cast truncates instead)."""
        op, f32 = self.op, self.f32
        cell = cell or (lambda t, hint: op("Floor", [t], hint))
        x0, y0 = cell(x, "x0"), cell(y, "y0")
        ax, ay = op("Sub", [x, x0], "ax"), op("Sub", [y, y0], "ay")
        nx, ny = op("Sub", [f32(1), ax], "nax"), op("Sub", [f32(1), ay], "nay")
        x1, y1 = op("Add", [x0, f32(1)], "x1"), op("Add", [y0, f32(1)], "y1")
        total = None
        for k, (px, py, wx, wy) in enumerate(((x0, y0, nx, ny), (x1, y0, ax, ny), (x0, y1, nx, ay), (x1, y1, ax, ay))):
            inside = self.within(px, py, f"in{k}", True)
            col = op("Where", [inside, px, f32(0)], f"col{k}")
            row = op("Where", [inside, py, f32(0)], f"row{k}")
            term = op("Mul", [op("Mul", [wx, wy], f"w{k}"), self.pixels(row, col, f"v{k}", size)], f"t{k}")
            term = op("Where", [inside, term, f32(0)], f"k{k}")
            total = term if total is None else op("Add", [total, term], f"s{k}")
        self.ctx.add_node("Identity", [total], [out])

    def within(self, px, py, hint, right_open):
        """0 <= px < W and 0 <= py < H (right_open), or 0 <= px <= W - 1 and 0 <= py <= H - 1."""
        less = "Less" if right_open else "LessOrEqual"
        wmax, hmax = (self.w, self.h) if right_open else (self.w - 1, self.h - 1)
        low = self.op("And", [self.op("GreaterOrEqual", [px, self.f32(0)], hint + "_x0"),
                              self.op("GreaterOrEqual", [py, self.f32(0)], hint + "_y0")], hint + "_lo")
        high = self.op("And", [self.op(less, [px, self.f32(wmax)], hint + "_x1"),
                               self.op(less, [py, self.f32(hmax)], hint + "_y1")], hint + "_hi")
        return self.op("And", [low, high], hint)

    def weighted_sum(self, corners):
        """sum of wx * wy * pixels(row, col) over the four (row, col, wx, wy) corners, added in order."""
        terms = [self.op("Mul", [self.op("Mul", [wx, wy], f"w{k}"), self.pixels(row, col, f"v{k}")], f"t{k}")
                 for k, (row, col, wx, wy) in enumerate(corners)]
        return self.op("Add", [self.op("Add", [self.op("Add", terms[:2], "s2"), terms[2]], "s3"), terms[3]],
                       "warped")

    def flow_warp(self, fx, fy, fill, pwc_net, out):
        """optical_flow.flow_warp (FlowNet2's FlowWarp, PWC-Net's Warp with pwc_net) into `out`, from
        the flow's channels fx, fy: the same bounds, neighbours and fill as there."""
        x, y = self.plus_pixel_grid(fx, fy)
        inside = self.within(x, y, "inside", not pwc_net)
        x = self.op("Where", [inside, x, self.f32(0)], "xs")
        y = self.op("Where", [inside, y, self.f32(0)], "ys")
        x0, y0 = self.op("Floor", [x], "x0"), self.op("Floor", [y], "y0")
        ax, ay = self.op("Sub", [x, x0], "ax"), self.op("Sub", [y, y0], "ay")
        if pwc_net:
            x1, y1 = self.op("Ceil", [x], "x1"), self.op("Ceil", [y], "y1")
        else:
            x1 = self.op("Min", [self.op("Add", [x0, self.f32(1)], "x0_1"), self.f32(self.w - 1)], "x1")
            y1 = self.op("Min", [self.op("Add", [y0, self.f32(1)], "y0_1"), self.f32(self.h - 1)], "y1")
        nx, ny = self.op("Sub", [self.f32(1), ax], "nax"), self.op("Sub", [self.f32(1), ay], "nay")
        total = self.weighted_sum([(y0, x0, nx, ny), (y0, x1, ax, ny), (y1, x0, nx, ay), (y1, x1, ax, ay)])
        self.ctx.add_node("Where", [inside, total, self.f32(fill)], [out])
