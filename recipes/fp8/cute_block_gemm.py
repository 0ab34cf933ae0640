"""A block-scaled FP8 GEMM for Hopper in CUTLASS's Python DSL (issue 49's second candidate against cuBLAS's):
`d = a @ b^T` for operands in 1x128 or 128x128 blocks (recipes.fp8.blockwise's layout: E4M3 values (rows, K),
FP32 decode scales (rows / block rows, K / 128)), every pair the blockwise recipe trains with, into BF16 or FP32,
or added into an FP32 `d` (a weight gradient into its main gradient).

The kernel is persistent and warp-specialised, as Hopper GEMMs that reach the tensor cores' rate are: one warpgroup
only copies A and B tiles into a ring of shared-memory stages with TMA, and two warpgroups each own 64 rows of a
128 x TILE_N output tile. Each 128-wide K step is one scale block: its FP8 product is formed by WGMMA into a fresh
FP32 fragment, and that fragment, times the step's two scales, is added to the tile's FP32 sum in registers (the
"promotion" DeepGEMM and cuBLAS's block scaling do: the tensor cores' own FP8 accumulation never sums more than 128
products). Two fragments alternate, so that the tensor cores form step k+1's product while the warpgroup promotes
step k's (cuBLAS's and CUTLASS's examples wait for each product before promoting it). A K step's scales (a 1x128-block
operand's 128, a 128x128-block operand's one) come with its tiles: the copying warp loads them from global memory a
step ahead and writes them into the stage before it arms the stage's barrier, so a promotion reads shared memory.
(Read from global memory by the math warpgroups, each step's scales made a warpgroup wait out a global load before it
could issue the next step's last WGMMA, or promote: the SASS of that version shows the dependency.) With
`scales_by_tma`, a 1x128-block operand's 128 scales of a step come instead as one more TMA copy into the stage,
from their column-major layout (a step's row scales 512 contiguous bytes: the layout the blockwise producer kernel
writes and cuBLAS reads), counted by the stage's barrier with the tiles: the copying warp then waits on no load of
its own before it issues a step's copies (its lanes' loads do: the SASS shows each step's copies issued only after
the previous step's loads returned); a 128x128-block operand's one scale a step still comes through its lanes.

Needs M and N multiples of 128 and K of 256; `block_scaled_gemm` in recipes.fp8.block_gemm keeps the others.
Compiled for sm_90a on a machine without a GPU by tests/test_cute_block_gemm.py (CUTLASS's DSL compiles against
fake tensors); its numerics are checked against FP64 on a GPU (tests/test_gpu.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cuda.bindings import driver
from cutlass.cute.runtime import from_dlpack
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

SCALE_BLOCK = 128  # K steps of 128; a 128x128-block operand's rows come in 128s
TILE_M = 128  # two math warpgroups of 64 rows
TILE_N = 128
MATH_WARPGROUPS = 2
THREADS_PER_WARPGROUP = 128
LANES = 32
# setmaxnreg: the copying warpgroup gives its registers to the math ones (24 + 2 x 240 of 512 a thread); a per-row b's
# 32 column scales a K step spilled the math warpgroups' registers at 232
LOAD_REGISTERS, MATH_REGISTERS = 24, 240


def tile_group(n_tiles: int) -> int:
    """How many adjacent N tiles the persistent CTAs take side by side before moving down M (CUTLASS's scheduler
    swizzle): 8, or the largest power of two dividing `n_tiles` below it, since the scheduler pads N to a multiple of
    the group and would hand out tiles past the end (whose scales lie outside their tensors). In plain M-first order
    a wave of 132 CTAs reads 132 strips of A and one of B, so a tall A streams from DRAM once per N tile (llama3_8b
    fc1's weight gradient: 7.5 GB a GEMM, longer at the H100's 3.35 TB/s than its products take); in groups of 8 a
    wave reads about 17 strips of A and 8 of B, some 25 MB, inside the 50 MB L2 (docs/results/gemm.md)."""
    group = 8
    while n_tiles % group:
        group //= 2
    return group


class BlockScaledGemm:
    """The kernel for one block pair and output: `a_block_rows`, `b_block_rows` each 1 (1x128 blocks) or 128
    (128x128 blocks); `accumulate`: d += a @ b^T into FP32 d; `cluster_m` 1, or 2: CTAs in pairs along M, each
    copying half of the B tile they share into both with TMA multicast (M then a multiple of 2 x TILE_M), so that
    the pair reads it from L2 once; `scales_by_tma`: a 1x128-block operand's scales copied by TMA with its tiles
    (the module's doc). As many stages of A and B tiles as fit in shared memory."""

    def __init__(self, a_block_rows: int, b_block_rows: int, accumulate: bool = False, cluster_m: int = 1,
                 scales_by_tma: bool = False):
        if a_block_rows not in (1, SCALE_BLOCK) or b_block_rows not in (1, SCALE_BLOCK):
            raise ValueError(f"block rows are 1 or {SCALE_BLOCK}, got {a_block_rows} and {b_block_rows}")
        if cluster_m not in (1, 2):
            raise ValueError(f"cluster_m is 1 or 2, got {cluster_m}")
        self.a_block_rows, self.b_block_rows, self.accumulate = a_block_rows, b_block_rows, accumulate
        self.tile_shape_mnk = (TILE_M, TILE_N, SCALE_BLOCK)
        self.cluster_m = cluster_m
        # which operands' scales TMA copies: the 1x128-block ones, with scales_by_tma
        self.a_scales_by_tma, self.b_scales_by_tma = (scales_by_tma and rows == 1
                                                      for rows in (a_block_rows, b_block_rows))
        self.threads = (1 + MATH_WARPGROUPS) * THREADS_PER_WARPGROUP
        self.math_threads = MATH_WARPGROUPS * THREADS_PER_WARPGROUP
        self.epilogue_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.math_threads)

    def _setup(self, a: cute.Tensor, b: cute.Tensor, d: cute.Tensor):
        """Types, the tiled WGMMA, shared-memory layouts and stage counts, from the operands."""
        self.ab_dtype, self.d_dtype = a.element_type, d.element_type
        self.cta_layout_mnk = cute.make_layout((self.cluster_m, 1, 1))
        self.a_layout, self.b_layout = utils.LayoutEnum.from_tensor(a), utils.LayoutEnum.from_tensor(b)
        self.d_layout = utils.LayoutEnum.from_tensor(d)
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
            cutlass.Float32, (MATH_WARPGROUPS, 1, 1), tiler_mn=(64, self.tile_shape_mnk[1]))
        self.epi_tile = sm90_utils.compute_tile_shape_or_override(self.tile_shape_mnk, self.d_dtype,
                                                                  is_cooperative=True)
        self.epi_stages = 2
        # a stage: the A and B tiles of one K step and their scales (FP32)
        ab_bytes = (TILE_M + self.tile_shape_mnk[1]) * (SCALE_BLOCK * self.ab_dtype.width // 8 + 4)
        epi_bytes = cute.size(self.epi_tile) * self.d_dtype.width // 8 * self.epi_stages
        self.ab_stages = (utils.get_smem_capacity_in_bytes("sm_90") - epi_bytes - 1024) // ab_bytes
        self.a_smem_layout = sm90_utils.make_smem_layout_a(self.a_layout, self.tile_shape_mnk, self.ab_dtype,
                                                           self.ab_stages)
        self.b_smem_layout = sm90_utils.make_smem_layout_b(self.b_layout, self.tile_shape_mnk, self.ab_dtype,
                                                           self.ab_stages)
        self.epi_smem_layout = sm90_utils.make_smem_layout_epi(self.d_dtype, self.d_layout, self.epi_tile,
                                                               self.epi_stages)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, a_scale: cute.Tensor, b_scale: cute.Tensor,
                 d: cute.Tensor, max_active_clusters: cutlass.Constexpr, stream):
        """a (M, K, 1) and b (N, K, 1) E4M3, K-major; a_scale (M / a_block_rows, K / 128) and b_scale likewise,
        FP32, row-major, or column-major where TMA copies them (`scales_by_tma`); d (M, N, 1), N-major, BF16 or FP32
        (read too when accumulating)."""
        self._setup(a, b, d)
        tma_a, tma_tensor_a = self._tma_load(a, self.a_smem_layout, (TILE_M, SCALE_BLOCK), 1)
        tma_b, tma_tensor_b = self._tma_load(b, self.b_smem_layout, (self.tile_shape_mnk[1], SCALE_BLOCK),
                                             self.cluster_m)
        # (the copy and the TMA tensor of each operand's scales where TMA copies them, else None)
        tma_a_scale, a_scale = self._tma_scales(a_scale, TILE_M) if self.a_scales_by_tma else (None, a_scale)
        tma_b_scale, b_scale = (self._tma_scales(b_scale, self.tile_shape_mnk[1]) if self.b_scales_by_tma
                                else (None, b_scale))
        epi_smem = cute.slice_(self.epi_smem_layout, (None, None, 0))
        tma_d, tma_tensor_d = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), d, epi_smem, self.epi_tile)
        tiles = cute.zipped_divide(d, tiler=cute.slice_(self.tile_shape_mnk, (None, None, 0)))
        tile_counts = tiles[(0, (None, None, None))].shape
        scheduler = utils.PersistentTileSchedulerParams(tile_counts, (self.cluster_m, 1, 1),
                                                        tile_group(tile_counts[1]), True)
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(scheduler, max_active_clusters)

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_layout)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[self.d_dtype, cute.cosize(self.epi_smem_layout)], 1024]
            # (128-byte aligned: TMA's destination)
            a_scales: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, TILE_M * self.ab_stages], 128]
            b_scales: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.tile_shape_mnk[1] * self.ab_stages],
                                        128]

        self.shared_storage = SharedStorage
        kernel = self.kernel(tma_a, tma_tensor_a, tma_b, tma_tensor_b, tma_d, tma_tensor_d, d, a_scale, b_scale,
                             tma_a_scale, tma_b_scale, self.tiled_mma, self.cta_layout_mnk, self.a_smem_layout,
                             self.b_smem_layout, self.epi_smem_layout, scheduler)
        kernel.launch(grid=grid, block=[self.threads, 1, 1], cluster=(self.cluster_m, 1, 1), min_blocks_per_mp=1,
                      stream=stream)

    def _tma_load(self, tensor: cute.Tensor, smem_layout_staged, tile, multicast: int):
        op = (cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp() if multicast == 1
              else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp())
        return cute.nvgpu.cpasync.make_tiled_tma_atom(
            op, tensor, cute.slice_(smem_layout_staged, (None, None, 0)), tile, num_multicast=multicast)

    def _tma_scales(self, scale: cute.Tensor, rows: int):
        """The copy of one K step's `rows` scales of a tile (a column of the column-major scales) into a stage."""
        return cute.nvgpu.cpasync.make_tiled_tma_atom(cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), scale,
                                                      cute.make_layout((rows, 1)), (rows, 1))

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_d: cute.CopyAtom, mD_tma: cute.Tensor, mD: cute.Tensor, a_scale: cute.Tensor,
               b_scale: cute.Tensor, tma_a_scale, tma_b_scale, tiled_mma: cute.TiledMma, cta_layout_mnk: cute.Layout,
               a_smem_layout: cute.ComposedLayout, b_smem_layout: cute.ComposedLayout,
               epi_smem_layout: cute.ComposedLayout, scheduler_params: utils.PersistentTileSchedulerParams):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_d)

        cluster_coord = cta_layout_mnk.get_flat_coord(cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()))
        # the CTAs of the cluster that receive this CTA's half of the shared B tile (none: plain copies)
        b_multicast = 0
        if cutlass.const_expr(self.cluster_m > 1):
            b_multicast = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)

        storage = utils.SmemAllocator().allocate(self.shared_storage)
        tile_bytes = (cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem_layout, (None, None, 0)))
                      + cute.size_in_bytes(self.ab_dtype, cute.slice_(b_smem_layout, (None, None, 0)))
                      + 4 * (TILE_M * self.a_scales_by_tma + self.tile_shape_mnk[1] * self.b_scales_by_tma))
        # A stage is full when its TMA bytes landed (half of B from the other CTA of a pair; the scales TMA copies
        # among them), empty when each math warp of every CTA writing into it released it.
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(), num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MATH_WARPGROUPS * 4 * self.cluster_m),
            tx_count=tile_bytes, cta_layout_vmnk=cute.make_layout((1, self.cluster_m, 1, 1)), defer_sync=True)
        pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sD = storage.sD.get_tensor(epi_smem_layout.outer, swizzle=epi_smem_layout.inner)
        # (tile rows or columns, stage): a 128x128-block operand's one scale a step in row 0
        sA_scales = storage.a_scales.get_tensor(cute.make_layout((TILE_M, self.ab_stages)))
        sB_scales = storage.b_scales.get_tensor(cute.make_layout((self.tile_shape_mnk[1], self.ab_stages)))
        # (tile rows, 128, tiles along M or N, K steps, 1)
        gA = cute.local_tile(mA, cute.slice_(self.tile_shape_mnk, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.tile_shape_mnk, (0, None, None)), (None, None, None))
        gD = cute.local_tile(mD_tma, cute.slice_(self.tile_shape_mnk, (None, None, 0)), (None, None, None))
        gD_values = cute.local_tile(mD, cute.slice_(self.tile_shape_mnk, (None, None, 0)), (None, None, None))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
                                                      cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(tma_b, cluster_coord[0], cute.make_layout(self.cluster_m),
                                                      cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        # the scales TMA copies: (copy, its stages in shared memory, a tile's K steps in global memory), else None
        a_scale_copy = b_scale_copy = None
        if cutlass.const_expr(self.a_scales_by_tma):
            a_scale_copy = self._scale_partition(tma_a_scale, a_scale, storage.a_scales, TILE_M)
        if cutlass.const_expr(self.b_scales_by_tma):
            b_scale_copy = self._scale_partition(tma_b_scale, b_scale, storage.b_scales, self.tile_shape_mnk[1])
        k_steps = cute.size(gA, mode=[3])
        pipeline_init_wait(cluster_shape_mn=(self.cluster_m, 1))

        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(LOAD_REGISTERS)
            if warp == 0:
                self._copy_tiles(tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, b_multicast, a_scale, b_scale, sA_scales,
                                 sB_scales, a_scale_copy, b_scale_copy, ring, scheduler_params, k_steps)
        else:
            cute.arch.setmaxregister_increase(MATH_REGISTERS)
            self._multiply(tidx - THREADS_PER_WARPGROUP, warp, tiled_mma, sA, sB, sD, gD, gD_values, tma_d,
                           sA_scales, sB_scales, ring, scheduler_params, k_steps)

    def _scale_partition(self, tma_scale, scale, smem, rows: int):
        """(the copy, its stages (rows, 1) in `smem`, the scales' (rows, 1) tiles by (tile, K step)) as
        cute.nvgpu.cpasync.tma_partition gives them for one operand's scales."""
        stages = smem.get_tensor(cute.make_layout((rows, 1, self.ab_stages)))
        tiles = cute.local_tile(scale, (rows, 1), (None, None))
        in_smem, in_gmem = cute.nvgpu.cpasync.tma_partition(tma_scale, 0, cute.make_layout(1),
                                                            cute.group_modes(stages, 0, 2),
                                                            cute.group_modes(tiles, 0, 2))
        return tma_scale, in_smem, in_gmem

    @cute.jit
    def _copy_tiles(self, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, b_multicast, a_scale, b_scale, sA_scales,
                    sB_scales, a_scale_copy, b_scale_copy, ring, scheduler_params, k_steps):
        """The copying warp: every K step of every tile this CTA owns, into the next free stage: the scales its
        lanes load, held in registers since the step before (the global load's latency behind them), written by
        the lanes; then the stage's barrier armed for the TMA copies of the tiles (and of the scales TMA copies),
        which complete it."""
        lane = cute.arch.lane_idx()
        scheduler = utils.StaticPersistentTileScheduler.create(scheduler_params, cute.arch.block_idx(),
                                                               cute.arch.grid_dim())
        work = scheduler.initial_work_tile_info()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        a_ahead = cute.make_rmem_tensor((TILE_M // LANES,), cutlass.Float32)
        b_ahead = cute.make_rmem_tensor((self.tile_shape_mnk[1] // LANES,), cutlass.Float32)
        while work.is_valid_tile:
            m_tile, n_tile, batch = work.tile_idx
            a_tiles, b_tiles = tAgA[(None, m_tile, None, batch)], tBgB[(None, n_tile, None, batch)]
            row0, col0 = m_tile * TILE_M, n_tile * self.tile_shape_mnk[1]
            if cutlass.const_expr(not self.a_scales_by_tma):
                self._load_scales(a_ahead, a_scale, self.a_block_rows, row0, 0, lane)
            if cutlass.const_expr(not self.b_scales_by_tma):
                self._load_scales(b_ahead, b_scale, self.b_block_rows, col0, 0, lane)
            state.reset_count()
            for _ in range(k_steps):
                ring.sync_object_empty.wait(state.index, state.phase)
                upcoming = cutlass.min(state.count + 1, k_steps - 1)
                if cutlass.const_expr(not self.a_scales_by_tma):
                    self._store_scales(a_ahead, sA_scales, self.a_block_rows, state.index, lane)
                    self._load_scales(a_ahead, a_scale, self.a_block_rows, row0, upcoming, lane)
                if cutlass.const_expr(not self.b_scales_by_tma):
                    self._store_scales(b_ahead, sB_scales, self.b_block_rows, state.index, lane)
                    self._load_scales(b_ahead, b_scale, self.b_block_rows, col0, upcoming, lane)
                cute.arch.sync_warp()  # every lane's scales written before the barrier's (releasing) arrive
                ring.sync_object_full.arrive(state.index, ring.producer_mask)
                barrier = ring.producer_get_barrier(state)
                cute.copy(tma_a, a_tiles[(None, state.count)], tAsA[(None, state.index)], tma_bar_ptr=barrier)
                cute.copy(tma_b, b_tiles[(None, state.count)], tBsB[(None, state.index)], tma_bar_ptr=barrier,
                          mcast_mask=b_multicast)
                if cutlass.const_expr(self.a_scales_by_tma):
                    self._copy_scales(a_scale_copy, m_tile, state, barrier)
                if cutlass.const_expr(self.b_scales_by_tma):
                    self._copy_scales(b_scale_copy, n_tile, state, barrier)
                ring.producer_commit(state)
                state.advance()
            scheduler.advance_to_next_work()
            work = scheduler.get_current_work()
        ring.producer_tail(state)

    @cute.jit
    def _copy_scales(self, scale_copy, tile, state, barrier):
        """A TMA copy of K step `state.count`'s scales of tile `tile` into the stage `state.index`."""
        atom, in_smem, in_gmem = scale_copy
        cute.copy(atom, in_gmem[(None, tile, state.count)], in_smem[(None, state.index)], tma_bar_ptr=barrier)

    @cute.jit
    def _load_scales(self, ahead, scale, block_rows, first, step, lane):
        """Into this lane's registers, K step `step`'s scales of the tile whose first row is `first`: every
        LANES-th row of a 1x128-block operand's, or a 128x128-block operand's one."""
        if cutlass.const_expr(block_rows == 1):
            for j in cutlass.range_constexpr(cute.size(ahead)):
                ahead[j] = scale[(first + lane + j * LANES, step)]
        else:
            ahead[0] = scale[(first // SCALE_BLOCK, step)]

    @cute.jit
    def _store_scales(self, ahead, smem_scales, block_rows, stage, lane):
        """This lane's scales of `_load_scales` into their stage."""
        if cutlass.const_expr(block_rows == 1):
            for j in cutlass.range_constexpr(cute.size(ahead)):
                smem_scales[(lane + j * LANES, stage)] = ahead[j]
        else:
            if lane == 0:
                smem_scales[(0, stage)] = ahead[0]

    @cute.jit
    def _multiply(self, math_tidx, warp, tiled_mma, sA, sB, sD, gD, gD_values, tma_d, sA_scales, sB_scales, ring,
                  scheduler_params, k_steps):
        """The math warpgroups: per K step a WGMMA product into one of two fresh fragments, promoted into the
        tile's sum with its scales while the next step's product forms; then the epilogue."""
        thr_mma = tiled_mma.get_slice(math_tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        mmas_per_step = cute.size(tCrA, mode=[2])
        acc_shape = thr_mma.partition_C(gD[(None, None, 0, 0, 0)]).shape
        total = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        products = (cute.make_rmem_tensor(acc_shape, cutlass.Float32),
                    cute.make_rmem_tensor(acc_shape, cutlass.Float32))
        # Each fragment element's (row, column) in the tile: the rows and columns whose scales it takes.
        coords = thr_mma.partition_C(cute.make_identity_tensor(cute.slice_(self.tile_shape_mnk, (None, None, 0))))

        r2s = cute.make_tiled_copy_S(
            sm90_utils.get_smem_store_op(self.d_layout, elem_ty_d=self.d_dtype, elem_ty_acc=cutlass.Float32),
            cute.make_tiled_copy_C_atom(
                cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(self.d_layout.is_m_major_c(), 4),
                                    self.d_dtype), tiled_mma))
        thr_r2s = r2s.get_slice(math_tidx)
        tRS_sD = thr_r2s.partition_D(sD)
        tRS_total = r2s.retile(total)
        piece_shape = cute.shape(thr_r2s.partition_S(sD))[:3]
        piece = cute.make_rmem_tensor(piece_shape, cutlass.Float32)
        piece_out = cute.make_rmem_tensor(piece_shape, self.d_dtype)
        stores = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.math_threads))

        scheduler = utils.StaticPersistentTileScheduler.create(scheduler_params, cute.arch.block_idx(),
                                                               cute.arch.grid_dim())
        work = scheduler.initial_work_tile_info()
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        while work.is_valid_tile:
            m_tile, n_tile, batch = work.tile_idx
            read.reset_count()
            release.reset_count()
            total.fill(0.0)
            # K steps in pairs (K a multiple of 256): products[0] holds the even steps, products[1] the odd ones.
            read = self._product(tiled_mma, products[0], tCrA, tCrB, ring, read, mmas_per_step)
            for pair in range(k_steps // 2):
                step = pair * 2
                read = self._product(tiled_mma, products[1], tCrA, tCrB, ring, read, mmas_per_step)
                cute.nvgpu.warpgroup.wait_group(1)  # the even step's product done, the odd one's in flight
                self._promote(total, products[0], coords, sA_scales, sB_scales, release.index)
                ring.consumer_release(release)
                release.advance()
                if step + 2 < k_steps:
                    read = self._product(tiled_mma, products[0], tCrA, tCrB, ring, read, mmas_per_step)
                    cute.nvgpu.warpgroup.wait_group(1)
                else:
                    cute.nvgpu.warpgroup.wait_group(0)
                self._promote(total, products[1], coords, sA_scales, sB_scales, release.index)
                ring.consumer_release(release)
                release.advance()
            if cutlass.const_expr(self.accumulate):
                tile_values = thr_mma.partition_C(gD_values[(None, None, m_tile, n_tile, batch)])
                for i in cutlass.range_constexpr(cute.size(total)):
                    total[i] = total[i] + tile_values[i]
            self._store(total, tRS_total, piece, piece_out, r2s, tRS_sD, sD, gD, tma_d, stores, scheduler, warp,
                        m_tile, n_tile, batch)
            scheduler.advance_to_next_work()
            work = scheduler.get_current_work()
        stores.producer_tail()

    @cute.jit
    def _product(self, tiled_mma, product, tCrA, tCrB, ring, read, mmas_per_step):
        """Issue one K step's WGMMAs into `product`, zeroing it first (ACCUMULATE off for the first); the read state
        moved on (returned: the tracer carries only locals rebound in the loop)."""
        ring.consumer_wait(read)
        cute.nvgpu.warpgroup.fence()
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        for block in cutlass.range_constexpr(mmas_per_step):
            coord = (None, None, block, read.index)
            cute.gemm(tiled_mma, product, tCrA[coord], tCrB[coord], product)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        read.advance()
        return read

    @cute.jit
    def _promote(self, total, product, coords, sA_scales, sB_scales, stage):
        """total += product x its rows' and columns' scales, read from the product's stage (held until this is
        done)."""
        for i in cutlass.range_constexpr(cute.size(total)):
            row, col = coords[i]
            a_row = row if cutlass.const_expr(self.a_block_rows == 1) else 0
            b_row = col if cutlass.const_expr(self.b_block_rows == 1) else 0
            total[i] = total[i] + product[i] * (sA_scales[(a_row, stage)] * sB_scales[(b_row, stage)])

    @cute.jit
    def _store(self, total, tRS_total, piece, piece_out, r2s, tRS_sD, sD, gD, tma_d, stores, scheduler, warp,
               m_tile, n_tile, batch):
        """The tile through shared memory to global memory with TMA, one epilogue piece at a time."""
        tiles = cute.zipped_divide(gD[(None, None, m_tile, n_tile, batch)], self.epi_tile)
        bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2),
                                                          tiles)
        pieces = cute.size(tiles, mode=[1])
        piece_layout = cute.make_layout(tiles.shape[1], stride=(tiles.shape[1][1], 1))
        first = scheduler.num_tiles_executed * pieces
        for p in cutlass.range_constexpr(pieces):
            for v in cutlass.range_constexpr(cute.size(piece)):
                piece[v] = tRS_total[p * cute.size(piece) + v]
            piece_out.store(piece.load().to(self.d_dtype))
            buffer = (first + p) % self.epi_stages
            cute.copy(r2s, piece_out, tRS_sD[(None, None, None, buffer)])
            cute.arch.fence_proxy("async.shared", space="cta")
            self.epilogue_barrier.arrive_and_wait()
            if warp == 4:  # the first math warp
                cute.copy(tma_d, bSG_sD[(None, buffer)], bSG_gD[(None, piece_layout.get_hier_coord(p))])
                stores.producer_commit()
                stores.producer_acquire()
            self.epilogue_barrier.arrive_and_wait()


_COMPILED: dict[tuple, object] = {}


def _cute_tensor(t, dtype, batch: bool = True):
    """A torch tensor as CUTLASS's DSL takes it: (rows, columns, 1) with a unit batch mode for the operands and the
    output, FP8 through its bytes (DLPack has no FP8 type)."""
    if batch:
        t = t.unsqueeze(0).permute(1, 2, 0)
    tensor = from_dlpack(t.view(torch.uint8) if t.element_size() == 1 else t, assumed_align=16)
    tensor.element_type = dtype
    return tensor


def kernel_scales(operand, by_tma: bool) -> torch.Tensor:
    """An operand's scales in the layout the kernel reads: a 1x128-block operand's column-major where TMA copies
    them (a K step's row scales contiguous; the blockwise producer kernel's own layout, so no copy then), every other
    row-major, as the copying warp's lanes load them."""
    scale = operand.scale_inv
    return scale.t().contiguous().t() if by_tma and operand.block[0] == 1 else scale.contiguous()


def cute_block_scaled_gemm(a, b, out_dtype=None, out=None, accumulate: bool = False, cluster_m: int = 1,
                           scales_by_tma: bool = False):
    """a @ b^T of two recipes.fp8 Float8Tensors in 1x128 or 128x128 blocks, a (M, K) and b (N, K), on a Hopper GPU:
    a new (M, N) tensor in `out_dtype` (default BF16), or written into FP32 `out` (added to it with `accumulate`).
    M a multiple of 128 x `cluster_m` (BlockScaledGemm's CTA pairs sharing B tiles with 2), N of 128, K of 256;
    `scales_by_tma`: BlockScaledGemm's. Each configuration and shape compiled once."""
    out_dtype = out_dtype or torch.bfloat16
    (rows, k), n = a.data.shape, b.data.shape[0]
    if rows % (TILE_M * cluster_m) or n % TILE_N or k % (2 * SCALE_BLOCK) or b.data.shape[1] != k:
        raise ValueError(f"the CUTLASS block-scaled GEMM needs M a multiple of {TILE_M * cluster_m}, N of {TILE_N} "
                         f"and K of {2 * SCALE_BLOCK}: {tuple(a.data.shape)} x {tuple(b.data.shape)}")
    if out is None:
        out = torch.empty((rows, n), dtype=out_dtype, device=a.data.device)
    elif accumulate and out.dtype != torch.float32:
        raise ValueError(f"accumulating needs an FP32 output, got {out.dtype}")
    d_type = cutlass.Float32 if out.dtype == torch.float32 else cutlass.BFloat16
    arguments = (_cute_tensor(a.data, cutlass.Float8E4M3FN), _cute_tensor(b.data, cutlass.Float8E4M3FN),
                 _cute_tensor(kernel_scales(a, scales_by_tma), cutlass.Float32, batch=False),
                 _cute_tensor(kernel_scales(b, scales_by_tma), cutlass.Float32, batch=False), _cute_tensor(out, d_type))
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    key = (a.block[0], b.block[0], accumulate, out.dtype, rows, n, k, cluster_m, scales_by_tma)
    if key not in _COMPILED:
        kernel = BlockScaledGemm(a.block[0], b.block[0], accumulate, cluster_m=cluster_m, scales_by_tma=scales_by_tma)
        _COMPILED[key] = cute.compile(kernel, *arguments, utils.HardwareInfo().get_max_active_clusters(cluster_m),
                                      stream)
    _COMPILED[key](*arguments, stream)
    return out
